"""The head's side of a running job: start-up, supervision, output, outcome and report."""
