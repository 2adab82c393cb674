#!/usr/bin/env bash
# The wheel check: what `pip install vescale_jax` gives a user works without the checkout.
#
#   tools/wheel_check.sh [--python PY] [--keep]
#
# 1. build: an sdist and a wheel (`PY -m build`, isolated; the wheel is built from the sdist, so the sdist must be
#    complete), from a copy of the working tree's files that git tracks or would add (untracked, not ignored: a new
#    module not yet committed); so the checkout gets no egg-info / build folders, and no ignored or stale file
#    (an old egg-info's SOURCES.txt, build/) slips into the distributions;
# 2. install: a clean venv (`PY -m venv`, no system site-packages) with the wheel and its `examples` extra, not
#    editable; pip's cache serves what it has already downloaded. PIP_CONSTRAINT, when set, applies as usual;
# then, from an empty directory outside the checkout (so the checkout is not on sys.path), with the venv's
# Python run isolated (`-I`: no PYTHONPATH, no user site, no script or current directory on sys.path; bytecode
# cached under the scratch directory):
# 3. import: `import vescale_jax` resolves to the venv's site-packages, at pyproject.toml's version;
# 4. package-files: every one of those files under vescale_jax/ (modules and data files: kernels/_measured.json,
#    ...) is in the installed package; a missing one is named (declare data files in
#    [tool.setuptools.package-data] of pyproject.toml; a package folder needs its __init__.py);
# 5. sdist-files: the same files are in the sdist;
# 6. readme-snippet: every ```python block of README.md, each run on its own as a user would paste it (XLA_FLAGS
#    unset, JAX_PLATFORMS=cpu, as docs/check_snippets.py runs them), importing the installed vescale_jax;
# 7. train-gpt: examples/train_gpt.py --steps 5, run from the checkout's examples/ (it imports its siblings there)
#    but importing the installed vescale_jax, which is checked after the run (vescale_jax.__file__).
#
# Each step prints its status and time; the build and install end the run when they fail, the checks all run and
# the script exits 1 if any failed. --python picks the interpreter (default python3; it needs `build`, from the
# test extra), --keep keeps the scratch directory (wheel-check.* in $TMPDIR, else /dev/shm when it has room, else
# /tmp) and says where it is.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=python3
KEEP=0
while (($#)); do
  case $1 in
    --python) PY=$2; shift 2 ;;
    --keep) KEEP=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "wheel_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
export PIP_DISABLE_PIP_VERSION_CHECK=1
# A relative PIP_CONSTRAINT (constraints/py311.txt) must survive the cd's below.
if [ -n "${PIP_CONSTRAINT:-}" ]; then
  abs=()
  for c in $PIP_CONSTRAINT; do
    if [ -e "$c" ]; then abs+=("$(cd "$(dirname "$c")" && pwd)/$(basename "$c")"); else abs+=("$c"); fi
  done
  PIP_CONSTRAINT="${abs[*]}"
  export PIP_CONSTRAINT
fi

# The scratch directory (~0.8 GB: the venv) goes to $TMPDIR if set, else to /dev/shm when it has 2 GiB free (on a
# disk the venv's install and removal took ~45 s more), else /tmp; pip's and build's own temporary files go in it.
base=${TMPDIR:-}
if [ -z "$base" ]; then
  base=/tmp
  if [ -d /dev/shm ] && [ -w /dev/shm ] && (($(df -Pk /dev/shm | awk 'NR == 2 {print $4}') > 2 * 1024 * 1024)); then
    base=/dev/shm
  fi
fi
WORK=$(mktemp -d "$base/wheel-check.XXXXXX")
mkdir -p "$WORK/tmp"
export TMPDIR=$WORK/tmp
echo "wheel-check: scratch directory $WORK"
cleanup() {
  if ((KEEP)); then
    echo "wheel-check: kept $WORK"
  else
    local t0
    t0=$(date +%s.%N)
    rm -rf "$WORK"
    echo "wheel-check: removed the scratch directory in $(since "$t0") s"
  fi
}
trap cleanup EXIT
SRC=$WORK/src DIST=$WORK/dist VENV=$WORK/venv OUTSIDE=$WORK/outside LOGS=$WORK/logs
mkdir -p "$SRC" "$DIST" "$OUTSIDE" "$LOGS"
VPY=$VENV/bin/python
# The venv's Python isolated (no PYTHONPATH, user site, script or current directory on sys.path), its bytecode
# cache in the scratch directory (nothing written into the checkout's examples/ or the venv).
VPYI=("$VPY" -I -X "pycache_prefix=$WORK/pycache")
T_START=$(date +%s.%N)
FAILED=()
SUMMARY=()

since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }

# step NAME required|check COMMAND...: runs COMMAND with its output in $LOGS/NAME.log (the tail shown on failure).
step() {
  local name=$1 kind=$2 rc=0 t0
  shift 2
  t0=$(date +%s.%N)
  echo "=== $name: $*"
  # a subshell outside any `||` list, so that `set -e` holds inside the step's functions
  set +e
  (
    set -e
    "$@"
  ) >"$LOGS/$name.log" 2>&1
  rc=$?
  set -e
  local took
  took=$(since "$t0")
  if ((rc == 0)); then
    grep '^wheel-check:' "$LOGS/$name.log" || true
    echo "=== $name: ok after $took s"
  else
    tail -n 40 "$LOGS/$name.log"
    echo "=== $name: FAILED (status $rc) after $took s"
    FAILED+=("$name")
  fi
  SUMMARY+=("$(printf '%-15s %-6s %7s s' "$name" "$( ((rc == 0)) && echo ok || echo FAILED)" "$took")")
  if ((rc != 0)) && [ "$kind" = required ]; then
    echo "=== wheel check failed at '$name' after $(since "$T_START") s" >&2
    exit 1
  fi
}

# The working tree's files that git tracks or would add (untracked, not ignored); a tracked file deleted there is
# left out.
tracked() {
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard "$@" | while IFS= read -r -d '' f; do
    if [ -e "$ROOT/$f" ]; then printf '%s\n' "$f"; fi
  done
}

build() {
  tracked | tar -C "$ROOT" -cf - -T - | tar -C "$SRC" -xf -
  "$PY" -m build --outdir "$DIST" "$SRC"
  echo "wheel-check: built $(cd "$DIST" && echo *)"
}

install() {
  "$PY" -m venv "$VENV"
  local wheels=("$DIST"/*.whl)
  # --no-compile: byte-compiling every installed module takes ~40 s; the checks compile only what they import,
  # once, into $WORK/pycache (the interpreters below run with -X pycache_prefix)
  "$VPY" -m pip install --no-compile "${wheels[0]}[examples]"
  "$VPY" -m pip list --format=freeze >"$WORK/installed.txt"
  echo "wheel-check: installed $(basename "${wheels[0]}")[examples] and $(wc -l <"$WORK/installed.txt") distributions in all" \
    "(PIP_CONSTRAINT ${PIP_CONSTRAINT:-unset}): $(grep -E '^(jax|jaxlib|flax|optax|orbax-checkpoint)==' "$WORK/installed.txt" | paste -sd' ')"
}

# The package's files: the expected list (git's) against the installed package / the sdist.
check_import() {
  cd "$OUTSIDE" && "${VPYI[@]}" - "$ROOT/pyproject.toml" <<'EOF'
import importlib.metadata, pathlib, sys, sysconfig, tomllib
import vescale_jax
where = pathlib.Path(vescale_jax.__file__).resolve()
site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
want = tomllib.loads(pathlib.Path(sys.argv[1]).read_text())["project"]["version"]
have = importlib.metadata.version("vescale_jax")
print(f"wheel-check: vescale_jax {have} (__version__ {vescale_jax.__version__}) imported from {where}")
assert where.is_relative_to(site), f"vescale_jax imported from {where}, not from the venv site-packages {site}"
assert have == want == vescale_jax.__version__, f"version {have} / {vescale_jax.__version__}, pyproject.toml {want}"
EOF
}

check_package_files() {
  tracked vescale_jax >"$WORK/expected.txt"
  cd "$OUTSIDE" && "${VPYI[@]}" - "$WORK/expected.txt" <<'EOF'
import pathlib, sys, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
expected = set(pathlib.Path(sys.argv[1]).read_text().split())
installed = {str(p.relative_to(site)) for p in (site / "vescale_jax").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
data = sorted(f for f in expected if not f.endswith(".py"))
missing = sorted(expected - installed)
extra = sorted(installed - expected)
print(f"wheel-check: {len(expected)} files under vescale_jax/ ({len(data)} data: {', '.join(data)}), {len(installed)} installed")
if extra:
    print(f"wheel-check: installed but not in the checkout: {', '.join(extra)}")
if missing:
    sys.exit(f"missing from the installed package ({len(missing)}): {', '.join(missing)}")
EOF
}

check_sdist_files() {
  local sdists=("$DIST"/*.tar.gz)
  tar -tzf "${sdists[0]}" | cut -d/ -f2- | grep -v '/$' | sort >"$WORK/sdist.txt"
  local missing
  missing=$(tracked vescale_jax | sort | comm -23 - "$WORK/sdist.txt")
  echo "wheel-check: $(basename "${sdists[0]}") holds $(wc -l <"$WORK/sdist.txt") files, $(grep -c '^vescale_jax/' "$WORK/sdist.txt") under vescale_jax/"
  if [ -n "$missing" ]; then
    echo "missing from the sdist: $missing"
    return 1
  fi
}

# Runs a script as __main__ (its own directory first on sys.path, as `python SCRIPT` does) in the isolated venv
# Python, then checks that the vescale_jax it imported is the installed one.
cat >"$WORK/run_installed.py" <<'EOF'
import pathlib, runpy, sys, sysconfig

script, *args = sys.argv[1:]
sys.argv = [script, *args]
sys.path.insert(0, str(pathlib.Path(script).resolve().parent))
status = 0
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as e:
    status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
module = sys.modules.get("vescale_jax")
site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
if module is None:
    print(f"wheel-check: {script} did not import vescale_jax", file=sys.stderr)
    status = status or 1
elif not pathlib.Path(module.__file__).resolve().is_relative_to(site):
    print(f"wheel-check: {script} imported vescale_jax from {module.__file__}, not from {site}", file=sys.stderr)
    status = status or 1
else:
    print(f"wheel-check: {pathlib.Path(script).name} ran with vescale_jax from {module.__file__} (status {status})")
sys.exit(status)
EOF

run_installed() { # run_installed SCRIPT ARGS...: from $OUTSIDE, XLA_FLAGS unset, on the CPU
  cd "$OUTSIDE" && env -u XLA_FLAGS JAX_PLATFORMS=cpu "${VPYI[@]}" "$WORK/run_installed.py" "$@"
}

check_readme() {
  "${VPYI[@]}" - "$ROOT/README.md" "$OUTSIDE" >"$WORK/snippets.txt" <<'EOF'
import pathlib, re, sys
# docs/check_snippets.py's fence: every ```python block of the page.
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
text = pathlib.Path(sys.argv[1]).read_text()
for m in FENCE.finditer(text):
    if m.group(1) == "python":
        line = text.count("\n", 0, m.start()) + 1
        path = pathlib.Path(sys.argv[2]) / f"README_line{line}.py"
        path.write_text(m.group(2))
        print(path)
EOF
  [ -s "$WORK/snippets.txt" ] || { echo "no \`\`\`python block in README.md"; return 1; }
  local snippet
  while IFS= read -r snippet; do
    local line=${snippet##*_line}
    echo "wheel-check: README.md's snippet at line ${line%.py}"
    run_installed "$snippet"
  done <"$WORK/snippets.txt"
}

check_train_gpt() {
  run_installed "$ROOT/examples/train_gpt.py" --steps 5
}

step build required build
step install required install
step import check check_import
step package-files check check_package_files
step sdist-files check check_sdist_files
step readme-snippet check check_readme
step train-gpt check check_train_gpt

echo "=== wheel check summary"
printf '  %s\n' "${SUMMARY[@]}"
if ((${#FAILED[@]})); then
  echo "=== wheel check FAILED (${FAILED[*]}) after $(since "$T_START") s" >&2
  exit 1
fi
echo "=== wheel check passed in $(since "$T_START") s"
