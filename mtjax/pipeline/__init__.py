"""Pipeline parallelism: schedules as tables (`schedules`), shown by `python -m mtjax.pipeline show`."""
