"""StreamConfig: worker processes are gone, and asking for them says what to use instead."""
import pytest

from shardtrain.load.config import StreamConfig


@pytest.mark.parametrize("n", [1, 2, -1])
def test_num_workers_other_than_zero_is_refused_naming_decode_threads(n):
    with pytest.raises(ValueError, match=rf"stream.num_workers={n}: .*removed.*stream.decode_threads"):
        StreamConfig(num_workers=n)
    assert StreamConfig(num_workers=0).num_workers == 0  # a config or checkpoint that says 0 still loads


def test_set_stream_num_workers_is_refused_with_the_same_message():
    from shardtrain.train.config import RunConfig
    from shardtrain.train.overrides import apply_overrides

    with pytest.raises(ValueError, match="decode_threads"):
        apply_overrides(RunConfig(), ["stream.num_workers=2"])
    assert apply_overrides(RunConfig(), ["stream.decode_threads=5"]).stream.decode_threads == 5
