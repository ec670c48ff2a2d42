# shellcheck shell=bash
# The dev virtualenv (dynsnap with its dev tools and its testenv extra, the local
# test environment's own dependencies), cached under $CACHE keyed by a hash of
# pyproject.toml; dynsnap itself is installed editable from this checkout on every
# run (cheap, no dependency resolution).

setup_python_venv() {
  local py="${DYNSNAP_PYTHON:-python3}"
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "dynsnap needs Python >= 3.11 ($py is $("$py" --version 2>&1))"
  local key; key=$(sha256sum "$ROOT/pyproject.toml" | cut -c1-12)
  export DYNSNAP_VENV="$CACHE/venv-dev-$key"
  if [[ ! -f "$DYNSNAP_VENV/.complete" ]]; then
    log "python: creating $DYNSNAP_VENV"
    rm -rf "$DYNSNAP_VENV"
    "$py" -m venv "$DYNSNAP_VENV"
    "$DYNSNAP_VENV/bin/pip" install -q --upgrade pip setuptools==80.9.0 wheel==0.45.1
    "$DYNSNAP_VENV/bin/pip" install -q -e "$ROOT[dev,testenv]" || die "pip install of dynsnap[dev,testenv] failed"
    touch "$DYNSNAP_VENV/.complete"
  fi
  "$DYNSNAP_VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT" >/dev/null 2>&1 \
    || die "editable install of dynsnap from $ROOT failed"
}
