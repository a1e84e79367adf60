"""The course's lectures: one file per lecture (`lecture_NN_topic.py`, its page), and one topic
package per lecture's building blocks (`model`, `data_parallel`, `tensor_parallel`, `pipeline`,
`context_parallel`, `layout`, `checkpoint`).

LECTURES is the one list of the course's lectures, in order: the Makefile, the tests, the
exercises and the notebooks' tools all take it from here.
"""
import os

_HERE = os.path.dirname(os.path.abspath(__file__))

LECTURES = sorted(f[:-3] for f in os.listdir(_HERE) if f.startswith("lecture_") and f.endswith(".py"))
