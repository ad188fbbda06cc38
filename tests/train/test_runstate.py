"""train/runstate.py: a run's state survives a checkpoint's round trip (optimiser moments, schedule, counters,
loader cursor, RNG), and weights that do not fit the model are refused naming what differs."""
from __future__ import annotations

import pytest
import torch

from pipelines import load_pipeline
from shardtrain.train.closedloop import ClosedLoop
from shardtrain.train.overrides import apply_overrides
from shardtrain.train.runstate import RunState
from shardtrain.train.text import CharVocab
from shardtrain.train.normalize import TextNormConfig

CPU = torch.device("cpu")


def _cfg(*extra: str):
    return apply_overrides(load_pipeline("tiny_cpu"), ["model.d_model=32", "model.num_layers=1", *extra])


def _steps(run: RunState, n: int) -> None:
    for _ in range(n):
        x = torch.randn(2, 40, 80)
        loss = run.raw_model.encode(x, torch.tensor([40, 30]))[0].float().pow(2).mean()
        run.optimizer.zero_grad()
        loss.backward()
        run.optimizer.step()
        run.scheduler.step()
        run.step += 1


def test_checkpoint_state_round_trips(tmp_path):
    cfg = _cfg()
    tok = CharVocab(list("abc "), TextNormConfig())
    run = RunState.build(cfg, tok, CPU)
    _steps(run, 3)
    run.loader_state, run.best_val, run.oom_splits = {"epoch": 0, "step": 3}, 1.25, 2
    closed = ClosedLoop(None, cfg.budget, None)
    state = {"main": run.main_state(closed), "rank": run.rank_state(CPU), "model": run.raw_model.state_dict(),
             "meta": {"config": {}}}
    torch.save(state, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=False)

    again = RunState.build(cfg, tok, CPU)
    again.fit_model(state, cfg, tmp_path / "ckpt.pt")
    torch.manual_seed(123)  # load() must put back the checkpoint's RNG, not keep this one
    again.load(state, CPU, seed=0)
    assert (again.step, again.best_val, again.oom_splits, again.loader_state) == (3, 1.25, 2, {"epoch": 0, "step": 3})
    assert again.scheduler.get_last_lr() == run.scheduler.get_last_lr()
    moments = lambda r: [s["exp_avg"] for s in r.optimizer.state_dict()["state"].values()]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(moments(again), moments(run), strict=True))
    assert torch.equal(torch.get_rng_state(), state["rank"]["rng_cpu"])
    for a, b in zip(again.raw_model.parameters(), run.raw_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_weights_of_another_model_are_refused_naming_the_difference(tmp_path):
    tok = CharVocab(list("abc "), TextNormConfig())
    small = RunState.build(_cfg(), tok, CPU)
    wide = _cfg("model.d_model=48")
    state = {"model": small.raw_model.state_dict(), "meta": {"config": {"model": {"d_model": 32}}}}
    with pytest.raises(ValueError, match=r"does not fit this model.*d_model"):
        RunState.build(wide, tok, CPU).fit_model(state, wide, tmp_path / "step-3.pt")
