"""The head's side of a running job: start-up, supervision, stdin, outcome and report (the
ranks' output is written by `launcher.output`)."""
