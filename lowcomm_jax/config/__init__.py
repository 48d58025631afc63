"""A run's configuration: the schema of every field (defaults.py), reading config files and
overrides (command_line.py), checking them once at start (check.py), describing them
(doc.py) and the one-line error every layer raises (error.py, below every other package)."""
