#!/usr/bin/env bash
# Install the kvpool daemon as a systemd service (README, "Install as a service"). Run as
# root from a clone of this repository. In this order:
#   1. pip install kvpool: into a venv (default /opt/kvpool) or, with --system, into the
#      system Python (pip's system-wide scripts folder, /usr/local/bin on Debian);
#   2. the `kvpool` user and group: systemd/kvpool.sysusers.conf, systemd-sysusers;
#   3. its directories: systemd/kvpool.tmpfiles.conf, systemd-tmpfiles;
#   4. the configuration /etc/kvpool/kvpool.toml (systemd/kvpool.toml; one already there
#      is kept);
#   5. the unit /etc/systemd/system/kvpool.service: systemd/kvpool.service with ExecStart=
#      the kvpool step 1 installed, SupplementaryGroups= those of video and render that
#      exist, ProtectHome=read-only when that kvpool lives under /home; checked by
#      `systemd-analyze verify`; the documentation it names in /usr/local/share/doc/kvpool;
#   6. systemctl enable --now kvpool (with --root: enable only).
# --root DIR does all of it inside DIR (a scratch root or an image: systemd-sysusers,
# systemd-tmpfiles, systemd-analyze and systemctl with --root=DIR; nothing is started).
# Every argument is checked first; a bad one gets one line and exit 2, a failed step one
# line (after the tool's own output) and exit 1.
set -euo pipefail
umask 022  # the daemon (user kvpool) must read what pip writes

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ROOT=/
VENV=/opt/kvpool
SYSTEM=0
VENV_SET=0
PYTHON=
PACKAGE=$HERE
# A path systemd gets verbatim in ExecStart= (no quoting, no %-specifiers, no spaces).
SAFE_PATH='^/[A-Za-z0-9._+/-]+$'

say() { printf 'kvpool-install: %s\n' "$*"; }
die() { printf 'kvpool-install: %s\n' "$*" >&2; exit 1; }
usage_error() {
    printf 'kvpool-install: %s (usage: %s [--venv DIR | --system] [--python PY] [--package SPEC] [--root DIR])\n' \
        "$1" "$0" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    opt=$1
    case $opt in
        --system) SYSTEM=1; shift; continue ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        --root=*|--venv=*|--python=*|--package=*) value=${opt#*=}; opt=${opt%%=*}; shift ;;
        --root|--venv|--python|--package)
            [ $# -ge 2 ] || usage_error "$opt needs a value"
            value=$2; shift 2 ;;
        *) usage_error "unknown argument: $opt" ;;
    esac
    case $opt in
        --root) ROOT=$value ;;
        --venv) VENV=$value; VENV_SET=1 ;;
        --python) PYTHON=$value ;;
        --package) PACKAGE=$value ;;
    esac
done

[ "$SYSTEM$VENV_SET" != 11 ] || usage_error "--venv and --system exclude each other"
[ -d "$ROOT" ] || usage_error "--root $ROOT is not a directory"
R=$(realpath -e -- "$ROOT")
R=${R%/}  # "" for /: every target path below is "$R/etc/...", the same on the real root
if [ "$SYSTEM" = 0 ]; then
    [[ $VENV =~ $SAFE_PATH ]] || usage_error "--venv $VENV: an absolute path of letters, digits and ._+-/ only"
    case /$VENV/ in */../*|*/./*|//) usage_error "--venv $VENV: no . or .. components, not /" ;; esac
fi
[ -n "$PACKAGE" ] || usage_error "--package needs a value"
if [ -z "$PYTHON" ]; then
    PYTHON=/usr/bin/python3
    [ -x "$PYTHON" ] || PYTHON=$(command -v python3 || true)
    [ -n "$PYTHON" ] || usage_error "no python3 found: name one with --python"
fi
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null ||
    usage_error "--python $PYTHON: not a Python 3.10 or later"
[ "$(id -u)" = 0 ] || die "run it as root (sudo): it creates a user, files in /etc and a service"
for tool in systemd-sysusers systemd-tmpfiles systemd-analyze systemctl; do
    command -v "$tool" >/dev/null ||
        die "$tool not found: this installs a systemd service (Debian/Ubuntu: apt-get install systemd)"
done

# Whether the daemon (user kvpool, no home access beyond ProtectHome=) can reach a file: every
# directory on its way searchable by others, the file itself executable by others. $1 is
# a path on this machine; the walk starts at $R when the path lies in it.
reachable() {
    local path=$1 base=/ cur part mode
    if [ -n "$R" ] && [[ $path == "$R"/* ]]; then base=$R; fi
    cur=$base
    IFS=/ read -ra parts <<< "${path#"$base"}"
    for part in "${parts[@]}"; do
        [ -n "$part" ] || continue
        if [ -d "$cur" ]; then
            mode=$(stat -c %a -- "$cur")
            (( (8#$mode & 1) == 1 )) || {
                echo "${cur#"$R"} (mode $mode: others may not enter it)"; return 1; }
        fi
        cur=${cur%/}/$part
    done
    if [ -e "$cur" ]; then
        mode=$(stat -c %a -- "$cur")
        (( (8#$mode & 5) == 5 )) || { echo "${cur#"$R"} (mode $mode)"; return 1; }
    fi
}

# The first folder or file on the way to $1 (a path on this machine, walked like
# reachable) that someone other than root may write (owner not root, or group/others
# write), if any: whoever can write there can change the code the daemon runs.
writable() {
    local path=$1 base=/ cur part owner mode
    if [ -n "$R" ] && [[ $path == "$R"/* ]]; then base=$R; fi
    cur=$base
    IFS=/ read -ra parts <<< "${path#"$base"}"
    for part in "${parts[@]}" ""; do
        if [ -e "$cur" ]; then
            owner=$(stat -c %u -- "$cur"); mode=$(stat -c %a -- "$cur")
            if [ "$owner" != 0 ] || (( (8#$mode & 8#022) != 0 )); then
                echo "${cur#"$R"} (owner uid $owner, mode $mode)"; return 0
            fi
        fi
        [ -n "$part" ] && cur=${cur%/}/$part
    done
    return 1
}

# 1. pip install
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
if [ "$SYSTEM" = 0 ]; then
    why=$(reachable "$R$VENV") || die "the kvpool user cannot reach $VENV: $why; choose a venv outside private folders (the default /opt/kvpool)"
    say "1/6 pip install $PACKAGE into the venv $VENV (made with $PYTHON)"
    [ -x "$R$VENV/bin/python" ] || "$PYTHON" -m venv -- "$R$VENV" || die "python -m venv $VENV failed (above)"
    "$R$VENV/bin/python" -m pip install --quiet -- "$PACKAGE" || die "pip install into $VENV failed (above)"
    EXE=$VENV/bin/kvpool
else
    scripts=$("$PYTHON" -c 'import sysconfig as s; print(s.get_path("scripts", s.get_preferred_scheme("prefix")))')
    say "1/6 pip install $PACKAGE into $PYTHON (system-wide: $scripts)"
    "$PYTHON" -m pip install --quiet --no-warn-script-location ${R:+--root "$R"} -- "$PACKAGE" ||
        die "pip install into $PYTHON failed (above); where the distribution manages that Python (PEP 668: Debian 12, Ubuntu 24.04) install into a venv instead (the default, --venv /opt/kvpool)"
    EXE=$scripts/kvpool
fi
[[ $EXE =~ $SAFE_PATH ]] || die "pip put kvpool at $EXE, which ExecStart= cannot name verbatim"
[ -x "$R$EXE" ] || die "pip did not install an executable $EXE"
PROTECT_HOME=yes
exe_real=$(realpath -e -- "$R$EXE")
interp=$(head -n 1 -- "$exe_real" | sed -n 's/^#! *\([^ ]*\).*/\1/p')
interp_real=$(realpath -e -- "$interp" 2>/dev/null) || die "$EXE runs $interp, which does not exist"
for f in "$exe_real" "$interp_real"; do
    why=$(reachable "$f") || die "the kvpool user cannot run $EXE: $why"
    case ${f#"$R"}/ in /home/*|/root/*|/run/user/*) PROTECT_HOME=read-only ;; esac
    if who=$(writable "$f"); then
        echo "kvpool-install: warning: $who: others than root may change the code the daemon runs ($EXE)" >&2
    fi
done

# 2. user and group
say "2/6 user and group kvpool (systemd-sysusers)"
install -D -m 0644 -- "$HERE/systemd/kvpool.sysusers.conf" "$R/etc/sysusers.d/kvpool.conf"
systemd-sysusers ${R:+--root="$R"} kvpool.conf || die "systemd-sysusers failed (above)"
grep -q '^kvpool:' "$R/etc/passwd" || die "systemd-sysusers made no kvpool user in $R/etc/passwd"

# 3. directories
say "3/6 directories /etc/kvpool, /var/lib/kvpool (systemd-tmpfiles)"
install -D -m 0644 -- "$HERE/systemd/kvpool.tmpfiles.conf" "$R/etc/tmpfiles.d/kvpool.conf"
systemd-tmpfiles ${R:+--root="$R"} --create kvpool.conf || die "systemd-tmpfiles failed (above)"

# 4. configuration
if [ -e "$R/etc/kvpool/kvpool.toml" ]; then
    say "4/6 configuration /etc/kvpool/kvpool.toml: kept (already there)"
else
    say "4/6 configuration /etc/kvpool/kvpool.toml (from systemd/kvpool.toml)"
    install -D -m 0644 -- "$HERE/systemd/kvpool.toml" "$R/etc/kvpool/kvpool.toml"
fi

# 5. unit
groups=
for g in video render; do
    if grep -q "^$g:" "$R/etc/group" 2>/dev/null; then groups="$groups $g"; fi
done
groups=${groups# }
say "5/6 unit /etc/systemd/system/kvpool.service (ExecStart=$EXE, groups: ${groups:-none}, ProtectHome=$PROTECT_HOME)"
unit=$(mktemp)
trap 'rm -f "$unit"' EXIT
edits=(-e "s#^ExecStart=/usr/local/bin/kvpool #ExecStart=$EXE #"
       -e "s#^ProtectHome=yes\$#ProtectHome=$PROTECT_HOME#")
[ -z "$groups" ] || edits+=(-e "/^UMask=/a SupplementaryGroups=$groups")
sed "${edits[@]}" -- "$HERE/systemd/kvpool.service" > "$unit"
grep -q "^ExecStart=$EXE daemon " "$unit" || die "systemd/kvpool.service has no ExecStart=/usr/local/bin/kvpool line to fill in"
for doc in README.md docs/ARCHITECTURE.md docs/THREAT-MODEL.md; do
    install -D -m 0644 -- "$HERE/$doc" "$R/usr/local/share/doc/kvpool/$(basename "$doc")"
done
install -D -m 0644 -- "$unit" "$R/etc/systemd/system/kvpool.service"
if [ -n "$R" ]; then
    systemd-analyze verify --root="$R" kvpool.service || die "systemd-analyze verify refused the unit (above)"
else
    systemd-analyze verify /etc/systemd/system/kvpool.service || die "systemd-analyze verify refused the unit (above)"
fi

# 6. enable
if [ -n "$R" ]; then
    say "6/6 systemctl --root=$R enable kvpool.service"
    systemctl --root="$R" --quiet enable kvpool.service || die "systemctl enable failed (above)"
else
    say "6/6 systemctl enable --now kvpool.service"
    systemctl daemon-reload || die "systemctl daemon-reload failed (above)"
    systemctl --quiet enable --now kvpool.service || die "systemctl enable --now failed (above): journalctl -u kvpool"
fi
say "done: tenants' users join the group kvpool (usermod -aG kvpool USER) to reach /run/kvpool"
