"""The error types a command-line run ends with: bad input (exit status 2) and faults (status 1)."""


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key, self.problem = key, problem


class RunFault(RuntimeError):
    """Not bad input but a failure of the machine while running (a full disk, a save that could
    not be written); the message is one line saying what was lost and what was kept."""
