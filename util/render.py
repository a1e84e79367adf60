"""Placeholder renderer (replaced)."""
def render_lecture(path): return path.replace(".json", ".html")
def render_index(out): pass
