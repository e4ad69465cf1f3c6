"""Result sets: results keyed by sample, persistent, resumable; collect_results."""
