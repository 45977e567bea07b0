# Sourced by the setup scripts: `venv_install VENV ARGS...` installs packages into the virtual environment
# VENV with uv, or with pip where uv cannot be had (DRAFTSMITH_INSTALLER=pip: pip always).
#
# Why uv: it resolves as pip does and downloads and unpacks in parallel. vLLM's CPU build and its ~150
# dependencies install in ~15 s with it against minutes with pip (a fresh cache each, this machine's
# registry); every setup from nothing (CI's included) pays that.
# uv reads no pip configuration, so pip's own (its config files and PIP_* variables: index, extra
# indexes, find-links, constraints, certificate) is handed to uv, and both install from the same
# places under the same caps. Extra indexes are merged as pip merges them (the best version of a
# package wins, whichever index holds it). ARGS are pip's (--no-deps, -c, -r, -e, --no-build-isolation,
# --force-reinstall).

_uv_for() {  # the uv binary for VENV: one on PATH, else one installed into VENV with pip
  local venv=$1
  if [ "${DRAFTSMITH_INSTALLER:-uv}" = pip ]; then
    return 1
  elif command -v uv > /dev/null 2>&1; then
    command -v uv
  elif [ -x "$venv/bin/uv" ] || "$venv/bin/python" -m pip install --quiet "uv>=0.9" > /dev/null 2>&1; then
    echo "$venv/bin/uv"
  else
    return 1
  fi
}

_pip_config_for_uv() {  # pip's settings (`pip config list`) as uv's environment, unless uv's own are set
  local venv=$1 key value
  while IFS='=' read -r key value; do
    value=${value#\'}; value=${value%\'}
    case "${key##*.}" in
      index-url) export UV_DEFAULT_INDEX="${UV_DEFAULT_INDEX:-$value}" ;;
      extra-index-url) export UV_INDEX="${UV_INDEX:-$value}" UV_INDEX_STRATEGY="${UV_INDEX_STRATEGY:-unsafe-best-match}" ;;
      find-links) export UV_FIND_LINKS="${UV_FIND_LINKS:-$value}" ;;
      constraint) export UV_CONSTRAINT="${UV_CONSTRAINT:-$value}" ;;
      cert) export SSL_CERT_FILE="${SSL_CERT_FILE:-$value}" ;;
    esac
  done < <("$venv/bin/python" -m pip config list 2> /dev/null)
}

venv_install() {
  local venv=$1 uv arg
  shift
  if ! uv=$(_uv_for "$venv"); then
    "$venv/bin/python" -m pip install --quiet "$@"
    return
  fi
  local args=()
  for arg in "$@"; do
    case "$arg" in
      --force-reinstall) args+=(--reinstall) ;;
      *) args+=("$arg") ;;
    esac
  done
  # Bytecode: where PYTHONDONTWRITEBYTECODE is set no process writes it, so each would compile what it
  # imports, every time (the suite took 1,972 s against 1,416): there it is compiled at install, as pip
  # does. Elsewhere Python writes it at first import, for only what is imported: the three environments
  # from nothing install in ~1 min against ~2 (all of torch, three times, and vLLM compiled). .ci/run unsets it.
  local compile=()
  [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] && compile=(--compile-bytecode)
  (_pip_config_for_uv "$venv" &&
    "$uv" pip install --quiet "${compile[@]}" --python "$venv/bin/python" "${args[@]}")
}

venv_uninstall() {  # venv_uninstall VENV PACKAGE...: those installed are removed, the others ignored
  local venv=$1 uv
  shift
  if uv=$(_uv_for "$venv"); then
    "$uv" pip uninstall --quiet --python "$venv/bin/python" "$@" 2> /dev/null || true
  else
    "$venv/bin/python" -m pip uninstall --quiet -y "$@" 2> /dev/null || true
  fi
}
