"""The trainer: arguments, configuration, the training loop, schedules and logging."""
