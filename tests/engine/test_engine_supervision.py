"""The supervised engine loop: an inbox item that raises never stops it; a step that raises
stops it for good, ends every stream with EngineDeadError and makes `health()` say why; a stalled
step is reported by the heartbeat (injected clock); calls have deadlines."""

import threading

import pytest

from tests.conftest import make_engine, make_prompt
from workers.engine.errors import EngineDeadError, EngineTimeoutError
from workers.engine.sampling_params import SamplingParams
from workers.engine_runner import EngineRunner

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def engine(tiny_model):
    return make_engine(tiny_model, num_spec_tokens=0, max_model_len=512)


def test_a_failing_inbox_item_goes_to_its_caller_and_the_loop_serves_on(engine):
    runner = EngineRunner(engine)
    try:
        with pytest.raises(ZeroDivisionError):
            runner.call(lambda e: 1 / 0)
        runner._inbox.put(lambda: [][1])  # a bare item (as abort's): logged, not fatal
        outs = list(runner.submit(make_prompt(30, 1), PARAMS))
        assert outs[-1].finished and len(outs[-1].token_ids) == 4
        assert runner.health() is None and not runner.dead.is_set()
    finally:
        runner.shutdown()


def test_a_step_that_raises_kills_the_loop_visibly(engine):
    runner = EngineRunner(engine)
    waiting = runner.submit(make_prompt(30, 2), SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
    next(iter(waiting))  # it is running

    def broken_step():
        raise RuntimeError("injected engine-loop fault")

    runner.call(lambda e: setattr(e, "step", broken_step))
    assert runner.dead.wait(2.0)  # the must-show bound: unhealthy within 2 s of the fault
    assert "injected engine-loop fault" in runner.health()
    with pytest.raises(EngineDeadError):
        list(waiting)  # the stream in flight ends with the error (the cluster retries it elsewhere)
    with pytest.raises(EngineDeadError):
        runner.submit(make_prompt(30, 3), PARAMS)
    with pytest.raises(EngineDeadError):
        runner.call(lambda e: None)


def test_a_stalled_step_is_reported_by_the_heartbeat_and_calls_time_out(engine):
    now = [0.0]
    release = threading.Event()
    runner = EngineRunner(engine, stall_timeout_s=5.0, clock=lambda: now[0])
    real_step = engine.step
    entered = threading.Event()

    def slow_step():
        entered.set()
        release.wait(30)
        return real_step()

    engine.step = slow_step
    try:
        stream = runner.submit(make_prompt(30, 4), PARAMS)
        assert entered.wait(10)
        assert runner.health() is None  # mid-step, heartbeat fresh
        now[0] += 6.0
        assert "stalled" in runner.health()
        errors = []
        caller = threading.Thread(target=lambda: _capture(errors, runner.call, lambda e: None, timeout_s=1.0))
        caller.start()
        while caller.is_alive():  # the loop is stuck in the step: the call waits until its deadline
            now[0] += 0.5
            caller.join(0.05)
        assert len(errors) == 1 and isinstance(errors[0], EngineTimeoutError)
        release.set()
        assert list(stream)[-1].finished
    finally:
        release.set()
        runner.shutdown()


def _capture(errors, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        errors.append(exc)
