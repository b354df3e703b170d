"""A failure that does not reproduce while Hypothesis shrinks it (its Flaky errors) is
reported as found -- unshrunk, marked flaky, with its diagnosis -- never lost as an
internal error of the search."""
from mla_fuzz.harness.fuzz import fuzz


def test_a_failure_that_does_not_reproduce_is_reported_not_raised():
    import cli_fakes

    cli_fakes.FlakyOnceBackend.fired, cli_fakes.FlakyOnceBackend.seen = False, 0
    report = fuzz("cli_fakes:FlakyOnceBackend", spec="tiny", graph_mode="eager", examples=60, seed=0,
                  device="cpu", shrink_seconds=20)
    assert cli_fakes.FlakyOnceBackend.fired, "the search never reached the faulty input"
    assert report.failed, "the one failure was dropped"
    repro = report.repro
    assert repro["search"]["flaky"].startswith("Flaky"), repro["search"]
    assert repro["failure"]["oracle"] and repro["steps"], repro["failure"]
    # the steps are the scenario as found: its last step is the one that failed, with a
    # real row of seq_len 0 in its batch
    last = repro["steps"][-1]["batch"]
    assert 0 in last["seq_lens"], last
    assert report.examples_to_detect is not None and report.examples_to_detect <= report.examples
