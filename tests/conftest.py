"""The project's own tests load gatherstore's opt-in pytest plugin (real Redis and S3)."""

import pytest

# the conformance suite's asserts explain their failures, as a test module's do
pytest.register_assert_rewrite("gatherstore.testing")

pytest_plugins = ["gatherstore.testing.plugin"]
