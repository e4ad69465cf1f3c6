"""Stand-in for vis4d.data."""
