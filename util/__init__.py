"""The course engine: narrate (record), launch ranks (launch), draw (figures), render (render).

Lectures import everything they need from here:

    from util import note, image, figure, table, see, span, spawn, timeline, settings, device, new_group
"""
from util.record import (note, image, figure, table, widget, see, span, span_at, quiet, deep_dive,
                         cheat, published, plural, try_it_yourself)
from util.launch import spawn, settings, device, mesh_options, new_group, Run, DemoFailed
from util.figures import timeline, progress

__all__ = ["note", "image", "figure", "table", "widget", "see", "span", "span_at", "quiet", "deep_dive",
           "cheat", "published", "plural", "try_it_yourself", "spawn",
           "settings", "device", "mesh_options", "new_group", "Run", "DemoFailed", "timeline", "progress"]
