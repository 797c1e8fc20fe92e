"""One module per ``lightning-preempt`` command: its options and what it prints."""
