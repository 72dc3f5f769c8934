"""pagedbatch: the command-line entry point (`pagedbatch ...` or `python -m pagedbatch`)."""
