"""The recording: one JSON file per built lecture, the only thing the renderer reads.

Data flows one way: lecture -> records (util.record) -> recording file (here) -> page
(util.render). Schema "course-lecture/1", one JSON object:

    schema, lecture, title, summary, module, file   what was built (summary: the docstring's
                                                    first paragraph after the title)
    built (UTC ISO time), elapsed (s), status      ok | failed
    startup                                        {workers, seconds}: worker start-up, apart
                                                   from the demos' own times
    environment                                    python, torch, backend, launcher, world_size,
                                                   quick, device, cores (which hardware measured it)
    demos                                          {total, failed, expected_failures, skipped}
    functions                                      key -> {file, name, start, code}
    records                                        see util/record.py; a "demo" record holds
                                                   the records its ranks made under "records"
                                                   and a short description of each rank's
                                                   return value under "returns"
"""
import json
import os
import re
import tempfile

SCHEMA = "course-lecture/1"


def write_atomic(path, data):
    """Write text or bytes to a temporary file beside `path`, then rename: readers never see
    half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; pages are for reading
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def save(path, recording):
    write_atomic(path, json.dumps(recording, indent=1))


def load(path):
    """A recording, or None when the file is not one (unreadable, not JSON, another schema)."""
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("schema") == SCHEMA else None


def trim_build_paths(text):
    """An error message without the source locations of PyTorch's build machine
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error" ->
    "Read error"): they name files on a machine the reader never saw."""
    text = re.sub(r"\[(?:/[^\]\s]*)+:\d+\]\s*", "", text or "")
    return re.sub(r"/__w/\S+\s*", "", text)
