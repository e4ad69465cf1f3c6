"""Stand-in for vis4d.common."""
