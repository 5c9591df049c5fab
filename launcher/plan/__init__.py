"""The job plan: every rank's place and environment, decided before anything starts."""
