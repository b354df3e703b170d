"""Our own backend through the shipped property suite (harness/suite), as a user would run it."""
from mla_fuzz.harness.suite.test_properties import *  # noqa: F401,F403
