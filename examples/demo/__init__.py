from examples.demo.task import make_example  # noqa: F401
