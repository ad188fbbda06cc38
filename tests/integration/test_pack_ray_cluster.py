"""`pack --engine ray` on a simulated two-node cluster (ray.cluster_utils.Cluster: two raylets on this machine, one
CPU each), so scan and shard tasks are spread over two raylets and records may cross between their object stores;
the output must be byte-identical to the local engine's. Its own module: a process joins one Ray cluster at a time."""
from __future__ import annotations


import pytest

from shardtrain.pack.packer import PackConfig, pack
from conftest import dataset_sha256s

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()



def test_two_node_cluster_output_identical_to_local(two_nodes, tone_corpus, tmp_path):
    assert len([n for n in two_nodes.nodes() if n["Alive"]]) == 2
    kw = dict(input=str(tone_corpus), max_samples_per_shard=4, part_items=4, progress=False)
    on_ray = pack(PackConfig(output=str(tmp_path / "ray"), engine="ray", **kw))
    pack(PackConfig(output=str(tmp_path / "local"), **kw))
    assert on_ray.shards == 8 and dataset_sha256s(tmp_path / "ray") == dataset_sha256s(tmp_path / "local")
