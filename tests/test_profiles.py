"""Property tests follow the Hypothesis profile: ``HYPOTHESIS_PROFILE=thorough`` must reach
every one of them, including those whose CI example count is set explicitly (an explicit
``@settings(max_examples=n)`` overrides the profile; ``helpers.examples(n)`` scales with it)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from helpers import CI_EXAMPLES, examples

TESTS = pathlib.Path(__file__).parent

# Imports every test module (tests/ and its subdirectories, each module by its file name, as
# pytest does) under a profile and prints {test: max_examples} for each Hypothesis test (its
# own settings, or the profile's when it has none).
LISTER = """
import importlib, inspect, json, pathlib, sys
sys.path.insert(0, {tests!r})
import conftest  # loads the profile named by HYPOTHESIS_PROFILE
from hypothesis import settings
counts = {{}}
for path in sorted(pathlib.Path({tests!r}).rglob("test_*.py"), key=lambda p: p.name):
    sys.path.insert(0, str(path.parent))
    module = importlib.import_module(path.stem)
    for name, fn in inspect.getmembers(module, callable):
        if name.startswith("test") and hasattr(fn, "hypothesis"):
            own = getattr(fn, "_hypothesis_internal_use_settings", None)
            counts[f"{{path.stem}}::{{name}}"] = (own or settings.default).max_examples
print(json.dumps(counts))
"""


def _counts(profile: str) -> dict:
    env = dict(os.environ, HYPOTHESIS_PROFILE=profile)
    done = subprocess.run([sys.executable, "-c", LISTER.format(tests=str(TESTS))], env=env, capture_output=True,
                          text=True, cwd=TESTS, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_thorough_profile_reaches_every_property_test():
    ci, thorough = _counts("ci"), _counts("thorough")
    assert ci.keys() == thorough.keys() and len(ci) > 10  # the lister found the property tests
    assert "test_attention::test_matches_reference" in ci  # one with a CI count of its own
    stuck = {name: (ci[name], thorough[name]) for name in ci if thorough[name] <= ci[name]}
    assert not stuck, f"HYPOTHESIS_PROFILE=thorough does not add examples to {stuck}"


def test_examples_is_n_in_ci_and_scales_with_the_profile():
    from hypothesis import settings

    loaded = settings.default.max_examples
    assert examples(12) == max(12, round(12 * loaded / CI_EXAMPLES))
    if loaded == CI_EXAMPLES:  # the default profile: CI counts as written
        assert examples(12) == 12 and examples(1) == 1
