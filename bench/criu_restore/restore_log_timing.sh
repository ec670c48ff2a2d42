#!/usr/bin/env bash
# Where one cold-cache CRIU restore of a 4 GiB bench/criu_restore/holder.py spends its time:
# dumps it with the stock CRIU, drops the page cache, restores it with CRIU (the first
# argument) at -v4, and prints the restore's wall time and the restorer's log lines for each
# large preadv() of the pages (CRIU's own timestamps, seconds since the restore started).
# Run as root: bench/criu_restore/restore_log_timing.sh CRIU [STOCK_CRIU_FOR_THE_DUMP]
set -euo pipefail
CRIU=$1; DUMPER=${2:-$1}
W=$(mktemp -d /var/tmp/restore-timing-XXXX); mkdir -m 0700 "$W/img"
trap 'rm -rf "$W"' EXIT
setsid python3 "$(dirname "$0")/holder.py" "$W" 4096 </dev/null >/dev/null 2>&1 &
for _ in $(seq 600); do [[ -f $W/ready ]] && break; sleep 0.2; done
PID=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['pid'])" "$W/ready")
"$DUMPER" dump -t "$PID" -D "$W/img" -o dump.log
sync; echo 3 > /proc/sys/vm/drop_caches
t0=$(date +%s%N)
"$CRIU" restore -D "$W/img" -o restore.log -v4 --restore-detached --pidfile "$W/rp"
t1=$(date +%s%N)
echo "restore wall: $(( (t1 - t0) / 1000000 )) ms"
grep -E "Preadv [0-9a-f]+:[0-9]{7,}|returned [0-9]{7,}|Restore finished" "$W/img/restore.log" | cut -c1-120
kill -9 "$(cat "$W/rp")"
