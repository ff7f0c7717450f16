"""Sphinx configuration: the API reference from the docstrings (autodoc, napoleon) and the Markdown pages
(MyST). ``make docs`` builds it into docs/_build/html with warnings as errors."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

project = "hvd_dssync"
root_doc = "index"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3
html_theme = "alabaster"
