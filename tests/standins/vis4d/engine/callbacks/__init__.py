"""Stand-in for vis4d.engine.callbacks."""
