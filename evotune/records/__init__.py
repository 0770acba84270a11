"""What a run leaves: run folders and their records, results, and the tuning table built from runs."""
