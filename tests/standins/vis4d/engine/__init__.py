"""Stand-in for vis4d.engine."""
