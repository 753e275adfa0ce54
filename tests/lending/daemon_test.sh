#!/usr/bin/env bash
# `shoal daemon` as a user runs it: flags, a config file (flags win), bad
# settings refused with a message naming them, `shoal daemon status`, JSON
# logs, and a clean exit on SIGTERM or SIGHUP that leaves no socket file behind.
#   daemon_test.sh <path of the shoal program> <path of shoal_test_borrower>
set -uo pipefail
shoal=$1
test_borrower=$2
dir=$(mktemp -d /tmp/shoal-daemon-test-XXXXXX)
chmod 700 "$dir"
pid=
cleanup() {
  [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "FAILED: $1"
  [ -f "$dir/log" ] && sed 's/^/  log: /' "$dir/log"
  exit 1
}
answers() {  # answers <socket> [<log>|-]: waits up to 5 s for the daemon to answer `status`, and for
             # the first record of its log (default $dir/log; - when it logs elsewhere)
  local log=${2:-$dir/log}
  for _ in $(seq 100); do
    if "$shoal" daemon status --socket "$1" --device host > "$dir/status" 2>/dev/null; then
      [ "$log" = - ] && return 0
      # The log is written by a thread of its own: the record may come a moment later.
      for _ in $(seq 100); do
        grep -qE 'event=started|"event":"started"' "$log" 2>/dev/null && return 0
        sleep 0.05
      done
      return 1
    fi
    sleep 0.05
  done
  return 1
}
stop() {  # stop [<signal>]: SIGTERM unless named, then the exit status must be 0 within 5 s
  local signal=${1:-TERM}
  kill -"$signal" "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
  wait "$pid" || fail "exit status $? after SIG$signal"
  pid=
}

# Flags alone, JSON logs.
"$shoal" daemon --socket "$dir/a.sock" --device host --capacity 64MiB --log-format json 2> "$dir/log" &
pid=$!
answers "$dir/a.sock" || fail "the daemon did not answer status"
grep -qx 'shoal_lending_capacity_bytes 67108864' "$dir/status" || fail "--capacity 64MiB is not the capacity"
# A client whose hello names a protocol in bytes that are no text (0xff, DEL,
# a terminal escape): the record that names it must stay one line of JSON.
python3 - "$dir/a.sock" <<'EOF' || fail "the bad hello could not be sent"
import socket, struct, sys, time
name = b"ev\xff\xfe\x7f\xc2\x9b31m"
payload = struct.pack("<I", len(name)) + name + struct.pack("<H", 1)
frame = struct.pack("<HHI", 0xFFFF, 0, len(payload)) + payload
batch = b"SHOL" + struct.pack("<HH", 2, 1) + struct.pack("<I", max(len(frame), 256 - 12)) + frame
batch += bytes(max(0, 256 - len(batch)))
with socket.socket(socket.AF_UNIX) as s:
    s.connect(sys.argv[1])
    s.sendall(batch)
    s.settimeout(10)
    while s.recv(4096):  # the lender closes it once its record is written
        pass
EOF
stop
[ ! -e "$dir/a.sock" ] || fail "the socket file was left behind"
python3 - "$dir/log" <<'EOF' || fail "the JSON log does not read as one object per line"
import json, sys
records = [json.loads(line) for line in open(sys.argv[1], encoding="ascii")]
events = [r["event"] for r in records]
assert events[0] == "started" and events[-1] == "stopping" and "connected" in events, events
# The name's bytes outside printable ASCII are written as \xNN escapes.
assert any(r"'ev\xff\xfe\x7f\xc2\x9b31m'" in r.get("detail", "") for r in records), "the bad hello's record"
assert records[0]["capacity_bytes"] == 67108864, "numbers are JSON numbers: " + repr(records[0])
assert all(type(r["pid"]) is int and type(r["bytes"]) is int for r in records if r["event"] == "connected")
EOF

# SIGHUP (its terminal closed) stops it as cleanly as SIGTERM: a stopping
# record, and neither the socket file nor the directory it made is left.
"$shoal" daemon --socket "$dir/hup/h.sock" --device host 2> "$dir/log" &
pid=$!
answers "$dir/hup/h.sock" || fail "the daemon did not answer status"
stop HUP
grep -q 'event=stopping signal=1 ' "$dir/log" || fail "no stopping record after SIGHUP"
[ ! -e "$dir/hup" ] || fail "the socket file or its directory was left after SIGHUP: $(ls -A "$dir/hup")"

# A config file, and a flag that wins over it.
cat > "$dir/conf.toml" <<EOF
socket = "$dir/b.sock"
device = "host"
capacity = "32MiB"
quota = "8MiB"
quota_per_uid = "24MiB"
max_wait_ms = 60000
max_observers = 2
max_connections_per_uid = 3
preempt_after_ms = 0
preempt_deadline_ms = 2500
log_rate = 7
EOF
"$shoal" daemon --config "$dir/conf.toml" --quota 16MiB 2> "$dir/log" &
pid=$!
answers "$dir/b.sock" || fail "the daemon of the config file did not answer"
grep -qx 'shoal_lending_capacity_bytes 33554432' "$dir/status" || fail "capacity from the file"
grep -q 'quota_bytes=16777216' "$dir/log" || fail "the --quota flag did not win over the file"
grep -q 'quota_bytes_per_uid=25165824' "$dir/log" || fail "quota_per_uid from the file"
grep -q 'max_wait_ms=60000' "$dir/log" || fail "max_wait_ms from the file"
grep -q 'max_observers=2 ' "$dir/log" || fail "max_observers from the file"
grep -q 'max_connections_per_uid=3 ' "$dir/log" || fail "max_connections_per_uid from the file"
grep -q 'preempt_after_ms=0 ' "$dir/log" || fail "preempt_after_ms from the file"
grep -q 'preempt_deadline_ms=2500' "$dir/log" || fail "preempt_deadline_ms from the file"
grep -q 'log_rate=7$' "$dir/log" || fail "log_rate from the file"
stop
"$shoal" daemon --config "$dir/conf.toml" --quota-per-uid 12MiB --max-connections-per-uid 0 2> "$dir/log" &
pid=$!
answers "$dir/b.sock" || fail "the daemon with --quota-per-uid did not answer"
grep -q 'quota_bytes_per_uid=12582912' "$dir/log" || fail "the --quota-per-uid flag did not win over the file"
grep -q 'max_connections_per_uid=0 ' "$dir/log" || fail "the --max-connections-per-uid flag did not win over the file"
stop
"$shoal" daemon --config "$dir/conf.toml" --no-preempt 2> "$dir/log" &
pid=$!
answers "$dir/b.sock" || fail "the daemon with --no-preempt did not answer"
grep -q 'preempt_after_ms=off' "$dir/log" || fail "--no-preempt did not turn off the file's preemption"
stop
# What the file turns on, a flag turns off: the per-uid quota ("none") and the HTTP endpoint.
printf 'metrics_port = 0\n' >> "$dir/conf.toml"
"$shoal" daemon --config "$dir/conf.toml" --quota-per-uid none --no-metrics-port 2> "$dir/log" &
pid=$!
answers "$dir/b.sock" || fail "the daemon with --quota-per-uid none --no-metrics-port did not answer"
grep -q 'quota_bytes_per_uid=0 ' "$dir/log" || fail "--quota-per-uid none did not turn off the file's: $(cat "$dir/log")"
grep -q 'metrics=off' "$dir/log" || fail "--no-metrics-port did not turn off the file's endpoint: $(cat "$dir/log")"
stop
sed -i '/^metrics_port = 0$/d' "$dir/conf.toml"
sed 's/^preempt_after_ms = 0$/preempt_after_ms = "off"/' "$dir/conf.toml" > "$dir/off.toml"
"$shoal" daemon --config "$dir/off.toml" 2> "$dir/log" &
pid=$!
answers "$dir/b.sock" || fail "the daemon with preempt_after_ms = \"off\" did not answer"
grep -q 'preempt_after_ms=off' "$dir/log" || fail "preempt_after_ms = \"off\" in the file did not turn it off"
stop
"$shoal" daemon --socket "$dir/b.sock" --device host 2> "$dir/log" &
pid=$!
answers "$dir/b.sock" || fail "the daemon with default settings did not answer"
grep -q 'preempt_after_ms=off' "$dir/log" || fail "preemption is on by default: $(cat "$dir/log")"
grep -q 'log_rate=20$' "$dir/log" || fail "the log's rate limit is not 20 a second by default: $(cat "$dir/log")"
stop

# --reuse reaches the lender (the log names the lender's own setting): the
# default, the flag, the file, and the flag over the file.
reuse_of() {  # reuse_of <expected> <daemon arguments...>
  local expected=$1
  shift
  "$shoal" daemon "$@" 2> "$dir/log" &
  pid=$!
  answers "$dir/r.sock" || fail "the daemon with '$*' did not answer"
  grep -q "reuse=$expected" "$dir/log" || fail "'$*' did not give the lender reuse $expected"
  stop
}
reuse_of same_uid --socket "$dir/r.sock" --device host --capacity 64MiB
reuse_of never --socket "$dir/r.sock" --device host --capacity 64MiB --reuse never
printf 'socket = "%s"\ndevice = "host"\ncapacity = "64MiB"\nreuse = "never"\n' "$dir/r.sock" > "$dir/reuse.toml"
reuse_of never --config "$dir/reuse.toml"
reuse_of same_uid --config "$dir/reuse.toml" --reuse same_uid

# Prepared chunks: from flags (repeated, COUNTxSIZE), from the file (a
# list), the flag winning; made at start and counted in the status.
"$shoal" daemon --socket "$dir/p.sock" --device host --capacity 64MiB --prepare 2x4MiB --prepare 2MiB 2> "$dir/log" &
pid=$!
answers "$dir/p.sock" || fail "the daemon with --prepare did not answer"
grep -qx 'shoal_lending_prepared_bytes 10485760' "$dir/status" || fail "--prepare 2x4MiB --prepare 2MiB: not 10 MiB"
grep -qx 'shoal_lending_prepared_chunks 3' "$dir/status" || fail "--prepare 2x4MiB --prepare 2MiB is not 3 chunks"
grep -qx 'shoal_lending_free_bytes 56623104' "$dir/status" || fail "prepared bytes are not counted against the capacity"
grep -q 'prepared_bytes=10485760' "$dir/log" || fail "the started record does not name the prepared bytes"
stop
cat > "$dir/prepare.toml" <<EOF
socket = "$dir/q.sock"
device = "host"
capacity = "64MiB"
prepare = ["3x2MiB"]
EOF
"$shoal" daemon --config "$dir/prepare.toml" 2> "$dir/log" &
pid=$!
answers "$dir/q.sock" || fail "the daemon with prepare in its file did not answer"
grep -qx 'shoal_lending_prepared_bytes 6291456' "$dir/status" || fail "prepare from the file"
stop
"$shoal" daemon --config "$dir/prepare.toml" --prepare 4MiB 2> "$dir/log" &
pid=$!
answers "$dir/q.sock" || fail "the daemon with --prepare over the file did not answer"
grep -qx 'shoal_lending_prepared_bytes 4194304' "$dir/status" || fail "the --prepare flag did not win over the file"
stop

# Bad settings: exit 2, the setting named.
refused() {  # refused <text the message must hold> <daemon arguments...>
  local expected=$1
  shift
  # (timeout: a daemon that took them would serve until stopped)
  timeout 10 "$shoal" daemon --socket "$dir/c.sock" --device host "$@" > /dev/null 2> "$dir/log"
  local status=$?
  [ "$status" -eq 2 ] || fail "'$*' exited $status, not 2"
  grep -q -- "$expected" "$dir/log" || fail "'$*' did not say '$expected'"
}
refused "more than the device's memory" --capacity 1000000TiB
echo 'capacity = "lots"' > "$dir/bad.toml"
refused "capacity" --config "$dir/bad.toml"
echo 'colour = "blue"' > "$dir/bad.toml"
refused "'colour' is not a setting" --config "$dir/bad.toml"
echo 'capacity = ' > "$dir/bad.toml"
refused "config file" --config "$dir/bad.toml"
refused "fraction" --capacity 2.5
# Less than one chunk of the device (2 MiB on the host) would refuse every
# borrow: the message names the smallest value taken. A TOML float is
# quoted as written, and read as a fraction however it is written.
refused "'1' is 1 bytes, less than one chunk of the device (2097152 bytes).*the smallest accepted value is 2MiB" \
  --capacity 1
refused "quota: '1' is 1 bytes.*smallest accepted value is 2MiB" --quota 1
refused "quota_per_uid: '2097151'.*smallest accepted value is 2MiB" --quota-per-uid 2097151
echo 'quota = 1' > "$dir/bad.toml"
refused "quota: '1' is 1 bytes.*smallest accepted value is 2MiB" --config "$dir/bad.toml"
echo 'capacity = 1e-10' > "$dir/bad.toml"
refused "capacity: '1e-10' is [0-9]* bytes, less than one chunk" --config "$dir/bad.toml"
refused "quota_per_uid" --quota-per-uid 0
# Without a GPU (or without the CUDA backend in this build), a CUDA device is
# refused with the daemon's own way to the host backend: the flag.
if ! nvidia-smi > /dev/null 2>&1; then
  timeout 10 "$shoal" daemon --socket "$dir/c.sock" --device cuda:0 > /dev/null 2> "$dir/log" &&
    fail "--device cuda:0 served without a GPU"
  grep -q -- "for the daemon: --device host" "$dir/log" || fail "--device cuda:0 without a GPU did not name --device host"
fi
# A size with a unit is whole: 1.5GiB was refused as a bad fraction, which misled.
refused "capacity: '1.5GiB' is not a size: a number with a unit is whole (write 1536MiB)" --capacity 1.5GiB
echo 'quota = "0.5KiB"' > "$dir/bad.toml"
refused "quota: '0.5KiB' is not a size: a number with a unit is whole (write 512)" --config "$dir/bad.toml"
# An empty size is refused for every key ("none" turns the per-uid quota off), not read as none.
echo 'quota_per_uid = ""' > "$dir/bad.toml"
refused "quota_per_uid: '' is not a size" --config "$dir/bad.toml"
refused "quota_per_uid: '' is not a size" --quota-per-uid ""
refused "excludes" --metrics-port 0 --no-metrics-port
# File counts stop where the flags' do (2^32).
echo 'max_borrowers = 4294967297' > "$dir/bad.toml"
refused "max_borrowers' must be an integer 1 to 4294967296" --config "$dir/bad.toml"
echo 'max_connections_per_uid = 9223372036854775807' > "$dir/bad.toml"
refused "max_connections_per_uid' must be an integer 0 to 4294967296" --config "$dir/bad.toml"
refused "not in {text,json}" --log-format xml
refused "same_uid" --reuse sometimes
echo 'reuse = "sometimes"' > "$dir/bad.toml"
refused "reuse: 'sometimes' is not same_uid or never" --config "$dir/bad.toml"
refused "prepare" --prepare lots
refused "over a day" --peer-timeout-ms 99999999999  # past a day overflowed into no timeout at all
refused "not in range" status --timeout 1e300
refused "prepare" --prepare 0x1MiB
refused "more than the capacity" --capacity 8MiB --prepare 3x4MiB
refused "max_wait must be" --max-wait-ms 0
refused "preempt-deadline-ms" --preempt-deadline-ms 0
refused "preempt_after must be" --preempt-after-ms 99999999999
refused "must be below max_wait" --preempt-after-ms 60000 --max-wait-ms 60000
refused "excludes" --preempt-after-ms 0 --no-preempt
echo 'preempt_after_ms = -1' > "$dir/bad.toml"
refused "preempt_after_ms' must be an integer >= 0" --config "$dir/bad.toml"
refused "log-rate" --log-rate -1
refused "log-rate" --log-rate 1000001
# Numeric flags in decimal only: CLI11 read "0100" as 64 (octal), "0x100" as 256, and
# "-18446744073709551615" as 1 (wrapped), each taken without a word.
refused "max-wait-ms: '0100' is not a whole number in decimal" --max-wait-ms 0100
refused "max-wait-ms: '0x100' is not a whole number in decimal" --max-wait-ms 0x100
refused "peer-timeout-ms: '-18446744073709551615' is not a whole number in decimal" --peer-timeout-ms -18446744073709551615
refused "max-borrowers: '010'" --max-borrowers 010
refused "preempt-deadline-ms: '010'" --preempt-deadline-ms 010
refused "log-rate: '010'" --log-rate 010
refused "allow-uid: '01750'" --allow-uid 01750
refused "metrics-port: '010'" --metrics-port 010
refused "timeout: '0x1p4' is not a decimal number" status --timeout 0x1p4
echo 'log_rate = -5' > "$dir/bad.toml"
refused "log_rate' must be an integer 0 to 1000000" --config "$dir/bad.toml"
echo 'log_rate = "fast"' > "$dir/bad.toml"
refused "log_rate' must be an integer 0 to 1000000" --config "$dir/bad.toml"

# A socket below a directory that does not exist is a bad setting (2); an
# address another daemon serves means this one cannot start (1). Each says why.
"$shoal" daemon --socket "$dir/missing/deeper/d.sock" --device host > /dev/null 2> "$dir/log"
status=$?
[ "$status" -eq 2 ] || fail "a socket below a missing directory exited $status, not 2"
grep -q "parent does not exist" "$dir/log" || fail "a socket below a missing directory: the message does not say so"
"$shoal" daemon --socket "$dir/u.sock" --device host 2> "$dir/log" &
pid=$!
answers "$dir/u.sock" || fail "the daemon did not answer status"
"$shoal" daemon --socket "$dir/u.sock" --device host > /dev/null 2> "$dir/second.log"
status=$?
[ "$status" -eq 1 ] || fail "a second daemon at a served address exited $status, not 1"
grep -q "already in use" "$dir/second.log" || fail "a second daemon at a served address: the message does not say so"
stop

# The reader of the daemon's log goes away (`shoal daemon 2>&1 | head`, a
# tee that died): the daemon goes on serving, and stops cleanly on SIGTERM.
mkfifo "$dir/logpipe"
head -c 1 < "$dir/logpipe" > /dev/null &
"$shoal" daemon --socket "$dir/c.sock" --device host 2> "$dir/logpipe" &
pid=$!
answers "$dir/c.sock" - || fail "the daemon did not answer status"
answers "$dir/c.sock" - || fail "the daemon died when the reader of its log went away"
stop

# With no daemon at the address, status says so and no more.
"$shoal" daemon status --socket "$dir/none.sock" --device host > /dev/null 2> "$dir/none" && fail "status without a daemon succeeded"
grep -q "no one listens at" "$dir/none" || fail "status without a daemon: $(cat "$dir/none")"
grep -q "older" "$dir/none" && fail "status without a daemon blames an older daemon: $(cat "$dir/none")"

# Against a daemon older than observer connections (it greets, then closes
# a connection whose hello is not a borrower's), status and revoke say that
# the daemon may be older than the command.
python3 - "$test_borrower" "$dir/old.sock" "$shoal" <<'EOF' || fail "the message for an older daemon"
import os, socket, subprocess, sys
test_borrower, address, shoal = sys.argv[1:]
parent, child = socket.socketpair()
end = child.fileno()
older = subprocess.Popen([test_borrower, "older-lender", "host", address, "2"],
                         pass_fds=(3, end), preexec_fn=lambda: os.dup2(end, 3))  # it talks on fd 3
child.close()
parent.settimeout(10)
lines = parent.makefile()
assert lines.readline().strip() == "listening"
for command in (["status"], ["revoke", "1"]):
    asked = subprocess.run([shoal, "daemon", *command, "--socket", address, "--device", "host", "--timeout", "5"],
                           capture_output=True, text=True, timeout=30)
    assert asked.returncode != 0, (command, asked.stdout)
    assert "older than this shoal command, which connects as an observer" in asked.stderr, (command, asked.stderr)
    seen = lines.readline().strip()
    assert seen.startswith("closed ") and "shoal.lending.observer" in seen, seen
lines.close()
parent.close()  # it ends when its parent hangs up
older.wait(timeout=30)
EOF

# `shoal daemon revoke`: a borrower process holds a region; the operator
# (this user) revokes it by the id status names, and status shows it
# revoking; a region no one holds is refused with a message naming it.
# At most two borrowers: with the holder and the waiter below it is full, and
# status and revoke (observers) are served all the same.
"$shoal" daemon --socket "$dir/d.sock" --device host --capacity 64MiB --max-borrowers 2 2> "$dir/log" &
pid=$!
answers "$dir/d.sock" || fail "the daemon did not answer status"
# status is an observer, not one of the borrowers
grep -qx 'shoal_lending_borrowers 0' "$dir/status" || fail "status counted itself: $(grep borrowers "$dir/status")"
grep -qx 'shoal_lending_observers 1' "$dir/status" || fail "status is not an observer: $(grep observers "$dir/status")"
python3 - "$test_borrower" "$dir/d.sock" "$shoal" <<'EOF' || fail "shoal daemon revoke"
import os, re, socket, subprocess, sys
test_borrower, address, shoal = sys.argv[1:]
parent, child = socket.socketpair()
end = child.fileno()
holder = subprocess.Popen([test_borrower, "hold", "host", address, str(4 << 20), "7"],
                          pass_fds=(3, end), preexec_fn=lambda: os.dup2(end, 3))  # it talks on fd 3
child.close()
parent.settimeout(10)
line = parent.makefile().readline().strip()
assert line.startswith("held "), line
region = line.split()[1]
revoked = subprocess.run([shoal, "daemon", "revoke", region, "--socket", address, "--device", "host",
                          "--deadline", "30"], capture_output=True, text=True, timeout=30)
assert revoked.returncode == 0, revoked.stderr
assert f"region {region}: its borrower is asked to give it back within 30 s" in revoked.stdout, revoked.stdout
status = subprocess.run([shoal, "daemon", "status", "--socket", address, "--device", "host"],
                        capture_output=True, text=True, timeout=30).stdout
assert re.search(r'shoal_lending_region_bytes\{id="' + region + r'"[^}]*state="revoking"', status), status
assert "\nshoal_lending_borrowers 1\n" in status, status  # the holder, not status itself
unknown = subprocess.run([shoal, "daemon", "revoke", "99999", "--socket", address, "--device", "host"],
                         capture_output=True, text=True, timeout=30)
assert unknown.returncode != 0 and "99999 is not lent" in unknown.stderr, unknown.stderr

# A borrow that waits: 62 MiB do not fit beside the holder's 4 MiB, so it
# waits in line (status counts it) and is lent once the holder is gone.
waiter_parent, waiter_child = socket.socketpair()
waiter_end = waiter_child.fileno()
waiter = subprocess.Popen([test_borrower, "wait-borrow", "host", address, str(62 << 20), "30000"],
                          pass_fds=(3, waiter_end), preexec_fn=lambda: os.dup2(waiter_end, 3))
waiter_child.close()
for _ in range(200):
    status = subprocess.run([shoal, "daemon", "status", "--socket", address, "--device", "host"],
                            capture_output=True, text=True, timeout=30).stdout
    if "shoal_lending_waiting_borrows 1\n" in status:
        break
else:
    raise AssertionError("the waiting borrow is not in status: " + status)
assert 'shoal_lending_waiting_borrow_bytes{place="0",pid="%d"' % waiter.pid in status, status
assert "\nshoal_lending_borrowers 2\n" in status, status  # the holder and the waiter
assert "\nshoal_lending_observers 1\n" in status, status  # status itself, served past --max-borrowers
# Full: a third borrower is turned away, the operator's revoke still served.
third_parent, third_child = socket.socketpair()
third_end = third_child.fileno()
third = subprocess.run([test_borrower, "hold", "host", address, str(1 << 20), "7"], capture_output=True, text=True,
                       timeout=30, pass_fds=(3, third_end), preexec_fn=lambda: os.dup2(third_end, 3))
third_child.close()
third_parent.close()
assert third.returncode == 1 and "turned this borrower away" in third.stderr, (third.returncode, third.stderr)
full = subprocess.run([shoal, "daemon", "revoke", "99999", "--socket", address, "--device", "host"],
                      capture_output=True, text=True, timeout=30)
assert full.returncode != 0 and "99999 is not lent" in full.stderr, full.stderr
parent.close()  # the holder ends when its parent hangs up: its region is reclaimed
holder.wait(timeout=30)
waiter_parent.settimeout(10)
lent = waiter_parent.makefile().readline().strip()
assert lent.startswith("lent "), lent
waiter_parent.close()
waiter.wait(timeout=30)
EOF
stop  # its log is written out by then
grep -q 'event=waiting' "$dir/log" || fail "the daemon's log has no waiting event: $(cat "$dir/log")"

# Preemption: with --preempt-after-ms 0 a borrow that waits gets the holder
# process's region revoked at once, named in status and in the log.
"$shoal" daemon --socket "$dir/p.sock" --device host --capacity 8MiB --preempt-after-ms 0 2> "$dir/log" &
pid=$!
answers "$dir/p.sock" || fail "the daemon with --preempt-after-ms did not answer"
python3 - "$test_borrower" "$dir/p.sock" "$shoal" <<'EOF' || fail "preemption"
import os, re, socket, subprocess, sys
test_borrower, address, shoal = sys.argv[1:]
def start(args):
    parent, child = socket.socketpair()
    end = child.fileno()
    process = subprocess.Popen([test_borrower, *args], pass_fds=(3, end), preexec_fn=lambda: os.dup2(end, 3))
    child.close()
    parent.settimeout(10)
    return process, parent
holder, holder_link = start(["hold", "host", address, str(8 << 20), "7"])
line = holder_link.makefile().readline().strip()
assert line.startswith("held "), line
region = line.split()[1]
waiter, waiter_link = start(["wait-borrow", "host", address, str(4 << 20), "30000"])
for _ in range(200):
    status = subprocess.run([shoal, "daemon", "status", "--socket", address, "--device", "host"],
                            capture_output=True, text=True, timeout=30).stdout
    if "shoal_lending_preemptions_total 1\n" in status:
        break
else:
    raise AssertionError("no preemption in status: " + status)
assert re.search(r'shoal_lending_region_bytes\{id="' + region + r'"[^}]*state="revoking"', status), status
assert "\nshoal_lending_borrowers 2\n" in status, status  # the holder and the waiter, not status itself
holder_link.close()  # the holder ends: its region is reclaimed, and the waiter lent
holder.wait(timeout=30)
lent = waiter_link.makefile().readline().strip()
assert lent.startswith("lent "), lent
waiter_link.close()
waiter.wait(timeout=30)
EOF
stop  # its log is written out by then
grep -q 'preempted for the borrow of 4194304 bytes' "$dir/log" || fail "the log does not name the preemption: $(cat "$dir/log")"

# A log reader that stops reading (a full pipe: a paused terminal, a stuck
# journal) while a borrower floods the log: borrowers and status are still
# served, and SIGTERM still stops the daemon (its log waits 2 s at most).
# (--log-rate 0: every record of the flood is written, none left out.)
mkfifo "$dir/stuck"
sleep 120 < "$dir/stuck" &  # holds the pipe's read end and reads nothing
reader=$!
"$shoal" daemon --socket "$dir/s.sock" --device host --capacity 64MiB --log-rate 0 2> "$dir/stuck" &
pid=$!
python3 - "$test_borrower" "$dir/s.sock" "$shoal" <<'EOF' || { kill "$reader"; fail "a stuck log reader stalled the daemon"; }
import os, socket, subprocess, sys, time
test_borrower, address, shoal = sys.argv[1:]
for _ in range(100):
    if os.path.exists(address):
        break
    time.sleep(0.05)
parent, child = socket.socketpair()
end = child.fileno()
# 1,000 borrows and give-backs: two lines of about 100 bytes each, past a pipe's 64 KiB.
cycler = subprocess.Popen([test_borrower, "cycle", "host", address, "4096", "1000", "self"],
                          pass_fds=(3, end), preexec_fn=lambda: os.dup2(end, 3))
child.close()
parent.settimeout(200)  # under TSan on a loaded 2-core machine the flood took past 100 s
line = parent.makefile().readline().strip()
assert line.startswith("cycled "), line
status = subprocess.run([shoal, "daemon", "status", "--socket", address, "--device", "host", "--timeout", "3"],
                        capture_output=True, text=True, timeout=30)
assert status.returncode == 0, status.stderr
parent.close()
cycler.wait(10)
EOF
kill -TERM "$pid"
for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
kill -0 "$pid" 2>/dev/null && { kill "$reader"; fail "the daemon did not stop within 5 s of SIGTERM with its log stuck"; }
wait "$pid" || { kill "$reader"; fail "exit status $? after SIGTERM with its log stuck"; }
pid=
kill "$reader"
wait "$reader" 2>/dev/null

# A log reader that stops reading and then reads again: what does not fit
# the pipe and the log's queue (8192 records) meanwhile is dropped, oldest
# first, and the log says so once it is read again (log_records_dropped,
# with the count so far), as does the stopping record. 12,000 refused
# give-backs are 12,000 records, past the queue and a 64 KiB pipe
# (--log-rate 0: none of them left out by the rate limit).
python3 - "$shoal" "$test_borrower" "$dir/o.sock" <<'EOF' || fail "the records dropped while the log's reader stalled"
import os, re, signal, socket, subprocess, sys, threading, time
shoal, test_borrower, address = sys.argv[1:]
read_end, write_end = os.pipe()  # read by no one until the flood is answered
daemon = subprocess.Popen([shoal, "daemon", "--socket", address, "--device", "host", "--capacity", "64MiB",
                           "--log-rate", "0"], stderr=write_end)
os.close(write_end)
flood = None
try:
    for _ in range(200):
        if os.path.exists(address):
            break
        time.sleep(0.05)
    parent, child = socket.socketpair()
    end = child.fileno()
    flood = subprocess.Popen([test_borrower, "refusals", "host", address, "12000"],
                             pass_fds=(3, end), preexec_fn=lambda: os.dup2(end, 3))  # it talks on fd 3
    child.close()
    parent.settimeout(60)
    line = parent.makefile().readline().strip()
    assert line == "refused 12000", "the flood of refusals: " + line
    parent.close()  # it ends when its parent hangs up
    flood.wait(timeout=30)
    # The reader reads again.
    log = bytearray()
    def read():
        while chunk := os.read(read_end, 1 << 16):
            log.extend(chunk)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    said = re.compile(rb"event=log_records_dropped records=[0-9]+ ")
    for _ in range(200):
        if said.search(bytes(log)):
            break
        time.sleep(0.05)
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(timeout=30) == 0, "the daemon's exit status"
    reader.join(timeout=30)
    assert not reader.is_alive(), "the log did not end with the daemon"
    text = bytes(log).decode()
    dropped = [int(n) for n in re.findall(r"event=log_records_dropped records=([0-9]+) ", text)]
    assert dropped and min(dropped) > 0, "no log_records_dropped record with a count:\n" + text[-2000:]
    stopping = re.findall(r"event=stopping .*log_records_dropped=([0-9]+)", text)
    assert len(stopping) == 1, "one stopping record:\n" + text[-2000:]
    assert int(stopping[0]) >= max(dropped), (stopping, max(dropped))
    refused = text.count("event=refused ")
    assert 0 < refused < 12000, f"{refused} of the 12000 refusals are in the log"
    assert "event=started" in text.split("\n")[0], "the first record, written before the pipe filled"
finally:
    for process in (flood, daemon):
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
EOF

# A borrower that floods the log (5,000 refused give-backs as fast as the
# lender answers, then a frame of no known type) under the default rate
# limit of 20 records a second after a burst of 200: most of its records are
# left out and counted; log_records_suppressed records say how many, by
# event, so that records written and records counted add up to what the
# lender did for it, exactly; the stopping record counts them too; and the
# warning (closed_for_error) is written past the limit. A second one floods
# and stays connected: its summary comes within 5 s all the same.
python3 - "$shoal" "$test_borrower" "$dir/f.sock" "$dir/flood" <<'EOF' || fail "the log's rate limit"
import os, re, signal, socket, subprocess, sys, time
shoal, test_borrower, address, log_path = sys.argv[1:]
def text():
    with open(log_path, encoding="ascii") as f:
        return f.read()
def wait_for(pattern, what, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if found := re.search(pattern, text(), re.M):
            return found
        time.sleep(0.05)
    raise AssertionError(f"{what}: not in the log within {seconds} s:\n" + text()[-3000:])
with open(log_path, "wb") as log:
    daemon = subprocess.Popen([shoal, "daemon", "--socket", address, "--device", "host", "--capacity", "64MiB"],
                              stderr=log)
flood = quiet = None
try:
    wait_for(r"event=started .*log_rate=20$", "the started record, with log_rate=20")
    def start(*args):
        parent, child = socket.socketpair()
        end = child.fileno()
        process = subprocess.Popen([test_borrower, "refusals", "host", address, *args],
                                   pass_fds=(3, end), preexec_fn=lambda: os.dup2(end, 3))  # it talks on fd 3
        child.close()
        parent.settimeout(120)
        return process, parent
    began = time.monotonic()
    flood, parent = start("5000", "then-bad")
    line = parent.makefile().readline().strip()
    took = time.monotonic() - began
    assert line == "refused 5000", "the flood of refusals: " + line
    # Its last records: the warning, then its disconnection (the lender
    # closed the connection), written or, past the limit, counted in a
    # summary of its own.
    wait_for(rf"event=closed_for_error pid={flood.pid} ", "the warning past the limit")
    wait_for(rf"event=disconnected pid={flood.pid} |event=log_records_suppressed pid={flood.pid} .*reason=disconnected",
             "its disconnection")
    parent.close()  # it ends when its parent hangs up
    flood.wait(timeout=30)
    # A borrower that floods, then stays connected and quiet: its summary
    # comes all the same, within 5 s of the first record left out (the
    # daemon looks each second).
    quiet, quiet_parent = start("5000")
    line = quiet_parent.makefile().readline().strip()
    assert line == "refused 5000", "the quiet borrower's refusals: " + line
    wait_for(rf"event=log_records_suppressed pid={quiet.pid} .*reason=interval", "the quiet borrower's summary", 15)
    quiet_parent.close()
    quiet.wait(timeout=30)
    wait_for(rf"event=disconnected pid={quiet.pid} |event=log_records_suppressed pid={quiet.pid} .*reason=disconnected",
             "the quiet borrower's disconnection")
    daemon.send_signal(signal.SIGTERM)
    assert daemon.wait(timeout=30) == 0, "the daemon's exit status"
    log = text()
    for pid in (flood.pid, quiet.pid):
        written = re.findall(rf"^\S+ \w+ event=(\w+) pid={pid} ", log, re.M)
        summaries = [(int(records), reason, {k: int(n) for k, n in re.findall(r"(\w+)=([0-9]+)", rest)})
                     for records, reason, rest in
                     re.findall(rf"event=log_records_suppressed pid={pid} uid=[0-9]+ records=([0-9]+) reason=(\w+)(.*)$",
                                log, re.M)]
        routine = [e for e in written if e not in ("closed_for_error", "log_records_suppressed")]
        refused = written.count("refused")
        left_out = sum(records for records, _, _ in summaries)
        refused_left_out = sum(by_event.get("refused", 0) for _, _, by_event in summaries)
        assert summaries and left_out > 0, f"no log_records_suppressed record for {pid}:\n" + log[-3000:]
        assert all(records == sum(by_event.values()) for records, _, by_event in summaries), summaries
        assert refused + refused_left_out == 5000, f"{pid}: {refused} written + {refused_left_out} left out != 5000"
        # connected, 5,000 refused, disconnected
        assert len(routine) + left_out == 5002, f"{pid}: {len(routine)} written + {left_out} left out != 5002: {summaries}"
        if pid == flood.pid:
            # At most the burst and 20 a second while it flooded (+1: a token refills meanwhile).
            assert refused <= 200 + 20 * took + 1, f"{refused} refusals written in {took:.1f} s"
            assert "closed_for_error" in written, "the warning"
    stopping = re.findall(r"event=stopping .*log_records_suppressed=([0-9]+)", log)
    every = sum(int(n) for n in re.findall(r"event=log_records_suppressed .*records=([0-9]+) ", log))
    assert stopping == [str(every)], f"stopping says {stopping}, the summaries {every}"
finally:
    for process in (flood, quiet, daemon):
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
EOF

# Settings a daemon cannot honour are refused before it starts: users of
# another uid cannot reach a socket path (its directory is 0700), counts
# below 1 or past 2^32 (CLI11 reads -1 into an unsigned number as its
# largest), NaN seconds, and prepared chunks past the capacity.
# (timeout: a daemon that took them would serve until stopped)
timeout 10 "$shoal" daemon --socket "$dir/u.sock" --device host --allow-uid 65534 2> "$dir/refusal"
[ $? -eq 2 ] && grep -q "abstract socket" "$dir/refusal" || fail "--allow-uid with a socket path: $(cat "$dir/refusal")"
timeout 10 "$shoal" daemon --socket "$dir/u.sock" --device host --max-borrowers -1 2> "$dir/refusal"
[ $? -eq 2 ] || fail "--max-borrowers -1 was taken"
timeout 10 "$shoal" daemon --socket "$dir/u.sock" --device host --max-observers 0 2> "$dir/refusal"
[ $? -eq 2 ] || fail "--max-observers 0 was taken (the config file refuses it too)"
timeout 10 "$shoal" daemon --socket "$dir/u.sock" --device host --max-connections-per-uid -1 2> "$dir/refusal"
[ $? -eq 2 ] || fail "--max-connections-per-uid -1 was taken"
timeout 10 "$shoal" daemon status --socket "$dir/u.sock" --device host --timeout nan 2> "$dir/refusal"
[ $? -eq 2 ] && grep -q "'nan' is not a decimal number" "$dir/refusal" || fail "--timeout nan: $(cat "$dir/refusal")"
timeout 10 "$shoal" daemon --socket "$dir/u.sock" --device host --capacity 64MiB --prepare 1000000x1 2> "$dir/refusal"
[ $? -eq 2 ] && grep -q "more than the capacity" "$dir/refusal" || fail "--prepare past the capacity: $(cat "$dir/refusal")"

# Status with no daemon there: exit 1.
"$shoal" daemon status --socket "$dir/none.sock" --device host --timeout 1 > /dev/null 2>&1
[ $? -eq 1 ] || fail "status with no daemon did not exit 1"

# A daemon of another user (a service account): status refuses it unless
# --daemon-uid names that uid. Needs root to start it as another user.
if [ "$(id -u)" -eq 0 ] && command -v setpriv > /dev/null; then
  svc=$(mktemp -d /tmp/shoal-daemon-svc-XXXXXX)
  chown 65534 "$svc" && chmod 700 "$svc"
  setpriv --reuid=65534 --regid=65534 --clear-groups \
    "$shoal" daemon --socket "$svc/s.sock" --device host --allow-uid 0 2> "$dir/log" &
  pid=$!
  for _ in $(seq 100); do [ -S "$svc/s.sock" ] && break; sleep 0.05; done
  "$shoal" daemon status --socket "$svc/s.sock" --device host --timeout 2 > /dev/null 2> "$dir/refusal"
  [ $? -eq 1 ] || fail "status accepted a daemon of uid 65534 without --daemon-uid"
  grep -q "65534" "$dir/refusal" || fail "the refusal does not name the daemon's uid: $(cat "$dir/refusal")"
  grep -q -- "--daemon-uid" "$dir/refusal" || fail "the refusal does not name --daemon-uid: $(cat "$dir/refusal")"
  "$shoal" daemon status --socket "$svc/s.sock" --device host --daemon-uid 65534 > "$dir/status" ||
    fail "status --daemon-uid 65534 did not read the daemon of uid 65534"
  grep -q '^shoal_lending_capacity_bytes ' "$dir/status" || fail "status --daemon-uid printed no metrics"
  # Root is an operator of any user's daemon: its revoke gets past the
  # operator check to the region (which no one holds).
  "$shoal" daemon revoke 99999 --socket "$svc/s.sock" --device host --daemon-uid 65534 > /dev/null 2> "$dir/refusal"
  grep -q "99999 is not lent" "$dir/refusal" || fail "root's revoke did not reach the region: $(cat "$dir/refusal")"
  stop
  rm -rf "$svc"
else
  echo "daemon: not root, the daemon of another user is not tried"
fi
echo "daemon: 1 passed, 0 failed"
