"""The task registry: ``TASKS.register(name)`` on a :class:`flarepp.tasks.base.Task` subclass."""

from flarepp.registry import Registry

TASKS: Registry = Registry("task")
