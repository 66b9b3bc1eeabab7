"""The Trainer's loop with a stand-in executor: hook order, preemption stops, the source is always closed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from disttrain_ds.runtime.callbacks.preemption import stop_line
from disttrain_ds.runtime.trainer import Callback, Trainer


class Source:
    last_wait_seconds = 0.25

    def __init__(self):
        self.closed = False

    def global_batch(self, step):
        return [step]

    def close(self):
        self.closed = True


class Executor:
    def __init__(self, stop_at=None, fail_at=None):
        self.stop_at, self.fail_at, self.finished = stop_at, fail_at, False

    def train_step(self, step, samples, data_wait, t0):
        if step == self.fail_at:
            raise RuntimeError("boom")
        return {"loss": float(step), "time/data_wait": data_wait}, step == self.stop_at

    def evaluate(self, batches):
        return {}

    def batch_view(self, samples):
        return samples

    def finish(self):
        self.finished = True


class Log(Callback):
    def __init__(self, events, name):
        self.events, self.name = events, name

    def on_train_start(self, trainer):
        self.events.append((self.name, "start"))

    def on_step_start(self, trainer):
        self.events.append((self.name, "step", trainer.step))

    def on_step_end(self, trainer, samples, rec):
        self.events.append((self.name, "end", rec["step"], samples))

    def on_train_end(self, trainer):
        self.events.append((self.name, "finish", trainer.preempted))


def _recipe(steps=3, every=0):
    return SimpleNamespace(train=SimpleNamespace(steps=steps), checkpoint=SimpleNamespace(every=every))


def test_hooks_run_in_list_order_around_each_step_from_the_resume_step():
    events, source, ex = [], Source(), Executor()
    t = Trainer(_recipe(3), source, ex, [Log(events, "a"), Log(events, "b")], start=1, keep_records=True)
    t.fit()
    assert events == [("a", "start"), ("b", "start"),
                      ("a", "step", 2), ("b", "step", 2), ("a", "end", 2, [1]), ("b", "end", 2, [1]),
                      ("a", "step", 3), ("b", "step", 3), ("a", "end", 3, [2]), ("b", "end", 3, [2]),
                      ("a", "finish", False), ("b", "finish", False)]
    assert [r["step"] for r in t.records] == [2, 3] and t.records[0]["time/data_wait"] == 0.25
    assert source.closed and ex.finished


def test_a_stop_request_ends_the_loop_after_that_step_unless_it_was_the_last():
    events = []
    t = Trainer(_recipe(5, every=2), Source(), Executor(stop_at=1), [Log(events, "a")])
    t.fit()
    assert t.preempted and t.step == 2 and events[-1] == ("a", "finish", True)
    t.last_checkpoint = "ckpt/step_00000002"
    assert stop_line(t) == ("preempted: checkpoint ckpt/step_00000002 saved at step 2; "
                            "relaunch with train.resume=auto to continue")
    last = Trainer(_recipe(2), Source(), Executor(stop_at=1), [])
    last.fit()
    assert not last.preempted and last.step == 2  # nothing left to stop early
    assert stop_line(Trainer(_recipe(5), Source(), Executor(), [])).endswith("no checkpoint written (checkpoint.every=0)")


def test_a_failing_step_still_closes_the_source():
    source = Source()
    with pytest.raises(RuntimeError, match="boom"):
        Trainer(_recipe(3), source, Executor(fail_at=1), []).fit()
    assert source.closed
