"""StepMetrics.compile_seconds: on the step's line, in TensorBoard's scalars and in the run's summary."""

from ppo_trainer.reporting.metrics import StepMetrics, summarize_run


def step(index: int, compile_seconds: float | None) -> StepMetrics:
    return StepMetrics(step=index, critic_only=False, reward_mean=0.5, response_tokens=100, samples=4, seconds=2.0,
                       compile_seconds=compile_seconds)


def test_a_step_that_compiled_says_so_on_its_line_and_in_tensorboard():
    first, later = step(0, 51.4), step(1, 0.0)
    assert " 2.00s compile 51.4s " in first.summary_line(4)
    assert "compile" not in later.summary_line(4)
    assert first.scalars()["time/compile_seconds"] == 51.4 and later.scalars()["time/compile_seconds"] == 0.0


def test_the_run_summary_sums_the_steps_compile_seconds_and_old_histories_count_none():
    old = {k: v for k, v in step(0, None).to_dict().items() if k != "compile_seconds"}  # before the field existed
    history = [StepMetrics.from_dict(old), step(1, 12.5), step(2, 0.25)]
    assert history[0].compile_seconds is None and "time/compile_seconds" not in history[0].scalars()
    assert summarize_run(history)["compileSeconds"] == 12.75
