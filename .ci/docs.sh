#!/usr/bin/env bash
# Build the documentation site strictly (any warning fails the build), offline, then run
# the Python examples of its pages (.ci/docs_examples.py).
#
#   .ci/docs.sh              build into a temporary directory (a check; it is removed after)
#   .ci/docs.sh build/site   build into build/site (open build/site/index.html)
#
# Python: $PYTHON if set, else .venv/bin/python if it exists, else python3. When MkDocs,
# Material or mkdocstrings are missing there, the 'docs' extra is installed first (that
# step needs a package index; the build itself never touches the network).
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi

if ! "$py" -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null; then
  echo "+ $py -m pip install -e '.[docs]'"
  "$py" -m pip install -q -e '.[docs]'
fi

if [ $# -ge 1 ]; then
  site_dir=$1
else
  site_dir=$(mktemp -d)
  trap 'rm -rf "$site_dir"' EXIT
fi

# NO_MKDOCS_2_WARNING: Material prints a banner about MkDocs 2.0 otherwise.
echo "+ mkdocs build --strict --site-dir $site_dir"
NO_MKDOCS_2_WARNING=1 "$py" -m mkdocs build --strict --clean --site-dir "$site_dir"

# The pages' Python examples must run against the code as it is.
echo "+ $py .ci/docs_examples.py"
"$py" .ci/docs_examples.py
