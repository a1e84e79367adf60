"""Fixture lecture: one demo whose ranks sleep, so that a test can signal a build mid-demo.
Each rank touches a file in $COURSE_TEST_MARKERS once it is asleep."""
import os
import time

from util import spawn


def sleep_long(rank, world_size):
    open(os.path.join(os.environ["COURSE_TEST_MARKERS"], f"rank{rank}"), "w").close()
    time.sleep(120)


def main():
    spawn(sleep_long, 2)
