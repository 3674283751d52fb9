"""Reward functions for tests/test_rewards.py and tests/test_grpo.py, in a module of their own so that the pool's
worker processes can import them (as `reward_fixtures`: the tests' directory is on sys.path, which the workers
inherit)."""

import os
import time

NOT_CALLABLE = 3


def length(completion):
    return float(len(completion))


def takes_all(completion, **fields):
    """The number of fields it was given (the record's, less any named `completion`)."""
    return float(len(fields))


def boom(completion, prompt):
    if "bad" in prompt:
        raise ValueError(f"cannot score {prompt!r}\nsecond line")
    return 1.0


def hang(completion, pidfile):
    """Hangs (60 s) on the completion "hang", after writing its process id to `pidfile`."""
    if completion == "hang":
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
    return 1.0


def pid(completion):
    return float(os.getpid())


def returns_none(completion):
    return None


def dies(completion):
    os._exit(3)


def no_args():
    return 1.0


def keyword_only(*, completion):
    return 1.0


def positional_only_field(completion, answer, /):
    return 1.0


def needs_a_missing_package(completion):
    return 1.0


needs_a_missing_package.requires = {"no_such_package_xyz": "no-such-package-xyz"}


def digits_match(completion, answer):
    """tests/test_grpo.py's: the share of the answer's digits the completion starts with, so that a tiny random
    model's rollouts already differ in reward."""
    digits = "".join(c for c in completion if c.isdigit())
    return sum(a == b for a, b in zip(digits, answer)) / len(answer)


def needs_a_field_the_prompts_lack(completion, solution):
    return 0.0
