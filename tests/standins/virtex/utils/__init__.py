"""Stand-in for virtex.utils."""
