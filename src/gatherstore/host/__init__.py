"""This machine's resources: free memory, unmapping threads, worker threads."""
