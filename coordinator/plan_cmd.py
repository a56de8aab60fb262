"""`moe-cluster plan`: the performance model as a command (placeholder until the model lands)."""


def add_arguments(p) -> None:
    p.add_argument("--model", required=True)


def main(args) -> int:
    raise ValueError("plan is not implemented yet")
