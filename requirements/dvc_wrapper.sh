#!/bin/sh
# requirements/dvc_wrapper.sh <venv bin folder>: make <bin>/dvc work without an activated venv.
#
# pip's `dvc` console script runs DVC on the venv's Python, but the stage commands DVC starts
# (`python -m stages.<name>`) run `python` from PATH: without `source .venv/bin/activate` that is the
# system's, and `.venv/bin/dvc repro` fails with "No module named 'torch'". The wrapper written here puts
# its own folder first on PATH, then execs the venv's `python -m dvc`, so the stages run in the venv.
# `make setup` runs it after every install; it rewrites the file only when its content differs.
set -eu
bin=$(cd "${1:?usage: dvc_wrapper.sh <venv bin folder>}" && pwd)
wrapper=$(cat <<'EOF'
#!/bin/sh
# Written by requirements/dvc_wrapper.sh (make setup): DVC on this venv's Python, with this folder first
# on PATH, so the `python` of the stage commands is the venv's even when the venv is not activated.
here=$(cd "$(dirname "$0")" && pwd)
PATH="$here:$PATH"
export PATH
exec "$here/python" -m dvc "$@"
EOF
)
if [ "$(cat "$bin/dvc" 2>/dev/null)" != "$wrapper" ]; then
    printf '%s\n' "$wrapper" > "$bin/dvc.tmp"
    chmod +x "$bin/dvc.tmp"
    mv -f "$bin/dvc.tmp" "$bin/dvc"
fi
