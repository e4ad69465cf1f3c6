"""The project's own tests load gatherstore's opt-in pytest plugin (real Redis and S3)."""

pytest_plugins = ["gatherstore.testing.plugin"]
