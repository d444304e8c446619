"""The one error type every user-facing input problem is reported with."""


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
