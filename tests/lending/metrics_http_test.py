#!/usr/bin/env python3
"""`shoal daemon --metrics-port` as a user and a hostile local client see it.

GET /metrics answers the lender's Prometheus text, other paths 404, other
methods 405; the endpoint listens on 127.0.0.1 alone; garbage, oversized
heads, bodies, slow clients and more connections than it serves at once are
closed without harming it, and idle connections holding every slot do not keep
a scraper out; a taken port is refused with a message naming it.
    metrics_http_test.py <path of the shoal program>
"""
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

SHOAL = sys.argv[1]
DEADLINE_S = 5  # metrics_endpoint::request_deadline
checks = 0


def check(ok, what):
    global checks
    if not ok:
        raise AssertionError(what)
    checks += 1


class Daemon:
    """A daemon on the host backend with its endpoint on a free port."""

    def __init__(self, folder, *args):
        self.log_path = os.path.join(folder, "log")
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [SHOAL, "daemon", "--device", "host", "--capacity", "64MiB", *args], stderr=self.log)
        self.port = None
        until = time.monotonic() + 5
        while self.port is None and time.monotonic() < until and self.process.poll() is None:
            found = re.search(r"metrics=http://127\.0\.0\.1:(\d+)/metrics", open(self.log_path).read())
            self.port = int(found.group(1)) if found else None
            time.sleep(0.02)
        check(self.port is not None, "the daemon did not log its metrics address:\n" + open(self.log_path).read())

    def stop(self):
        self.process.send_signal(signal.SIGTERM)
        check(self.process.wait(5) == 0, "the daemon did not exit 0 after SIGTERM")


def exchange(port, request, host="127.0.0.1"):
    """Sends `request` (bytes) and reads until the daemon closes: (status, headers, body), or None for no answer."""
    with socket.create_connection((host, port), timeout=DEADLINE_S + 3) as s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed on us mid-request: what counts is what it answered
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    if not data:
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body.decode()


def get(port, path="/metrics", method="GET"):
    return exchange(port, f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())


def listening_addresses(port):
    """The local addresses of the sockets listening on `port`, from /proc/net/tcp and tcp6."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if int(hex_port, 16) == port and fields[3] == "0A":  # TCP_LISTEN
                found.append(address)
    return found


def main():
    with tempfile.TemporaryDirectory(prefix="shoal-metrics-http-") as folder:
        os.chmod(folder, 0o700)
        config = os.path.join(folder, "daemon.toml")
        with open(config, "w") as f:
            f.write(f'socket = "{folder}/d.sock"\nmetrics_port = 0\n')
        daemon = Daemon(folder, "--config", config)
        port = daemon.port
        try:
            # What a scraper gets.
            status, headers, body = get(port)
            check(status == 200, f"GET /metrics answered {status}")
            check(headers.get("content-type", "").startswith("text/plain; version=0.0.4"), f"content type {headers}")
            check("\nshoal_lending_capacity_bytes 67108864\n" in "\n" + body, "the capacity is not in:\n" + body)
            check("# TYPE shoal_lending_requests_total counter" in body, "not Prometheus text:\n" + body)
            over_socket = subprocess.run([SHOAL, "daemon", "status", "--socket", f"{folder}/d.sock", "--device", "host"],
                                         capture_output=True, text=True, check=True).stdout
            check(over_socket.splitlines()[:6] == body.splitlines()[:6], "HTTP and the socket disagree")
            check(get(port, "/metrics?name=x")[0] == 200, "a query string is not the same path")
            check(get(port, "/")[0] == 404, "/ is not 404")
            check(get(port, "/metricsx")[0] == 404, "/metricsx is not 404")
            # A web page that rebinds its own name to 127.0.0.1 sends that name: refused.
            rebound = exchange(port, b"GET /metrics HTTP/1.1\r\nHost: rebound.example:%d\r\n\r\n" % port)
            check(rebound is not None and rebound[0] == 403, f"a request for another host name answered {rebound}")
            check(get(port)[0] == 200 and exchange(port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n"
                                                   % port)[0] == 200, "localhost and 127.0.0.1 are not served")
            for method in ("POST", "PUT", "DELETE", "HEAD", "BREW"):
                answer = get(port, "/metrics", method)
                check(answer is not None and answer[0] == 405, f"{method} /metrics answered {answer}")
                check(answer[1].get("allow") == "GET", f"{method}: no Allow: GET")

            # Loopback only: one listening socket, on 127.0.0.1; another loopback address is refused.
            check(listening_addresses(port) == ["0100007F"], f"listening on {listening_addresses(port)}")
            try:
                socket.create_connection(("127.0.0.2", port), timeout=2).close()
                refused = False
            except ConnectionRefusedError:
                refused = True
            check(refused, "the endpoint accepted a connection on 127.0.0.2: it is not bound to 127.0.0.1 alone")

            # Hostile requests: answered 400 or closed, never more than the bounds.
            for garbage in (os.urandom(3000), b"\x00" * 100 + b"\r\n\r\n", b"GET\r\n\r\n", b"GET /metrics HTTP/9.9\r\n\r\n",
                            b"GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789",
                            b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
                            b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
                            b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 5000 + b"\r\n",
                            b"GET /" + b"m" * 100000 + b" HTTP/1.1\r\n\r\n"):
                answer = exchange(port, garbage)
                check(answer is None or answer[0] == 400, f"{garbage[:40]!r}... answered {answer and answer[:2]}")
            # A head that never ends is cut at the bound: the daemon stops reading and closes.
            with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S + 3) as s:
                sent = 0
                try:
                    s.sendall(b"GET /metrics HTTP/1.1\r\n")
                    while sent < 64 << 20:
                        sent += s.send(b"X-Endless: " + b"z" * 4096 + b"\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                check(sent < 16 << 20, f"the daemon read {sent} bytes of one endless head")

            # A client that says nothing, and one that stops mid-request, are closed by the deadline.
            for opening in (b"", b"GET /metr"):
                with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S + 3) as s:
                    start = time.monotonic()
                    s.sendall(opening)
                    try:
                        check(s.recv(1) == b"", "a slow client got an answer")
                    except ConnectionResetError:
                        pass
                    waited = time.monotonic() - start
                    check(DEADLINE_S - 1 < waited < DEADLINE_S + 2, f"a slow client was closed after {waited:.1f} s")

            # More idle connections than it serves at once: the extra ones are closed at accept.
            idle = [socket.create_connection(("127.0.0.1", port), timeout=2) for _ in range(40)]
            closed_ones = set()
            looked_until = time.monotonic() + 2  # well before their 5 s deadline: closed at accept, not by it
            while len(closed_ones) < 24 and time.monotonic() < looked_until:
                for i, s in enumerate(idle):
                    if i in closed_ones:
                        continue
                    s.settimeout(0.01)
                    try:
                        if s.recv(1) == b"":
                            closed_ones.add(i)
                    except ConnectionResetError:
                        closed_ones.add(i)
                    except socket.timeout:
                        pass  # served: waiting for its request
            closed = len(closed_ones)
            check(closed >= 24, f"only {closed} of 40 idle connections were closed at once (16 are served)")
            # Idle connections hold every slot: a scraper is still answered at once (it takes
            # the slot of the one that has waited longest), without waiting out their deadline.
            start = time.monotonic()
            answer = get(port)
            waited = time.monotonic() - start
            check(answer is not None and answer[0] == 200 and waited < 1,
                  f"with every slot held by an idle connection, /metrics answered {answer and answer[0]} "
                  f"after {waited:.1f} s")
            for s in idle:
                s.close()
            until = time.monotonic() + DEADLINE_S + 2
            answer = None
            while answer is None and time.monotonic() < until:
                try:
                    answer = get(port)
                except (ConnectionResetError, socket.timeout):
                    time.sleep(0.1)
            check(answer is not None and answer[0] == 200, "after the hostile clients, /metrics is not served")
            check(daemon.process.poll() is None, "the daemon exited")

            # Two Host fields: which site was meant is not guessed.
            twice = exchange(port, b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n\r\n")
            check(twice is not None and twice[0] == 400, f"two Host fields answered {twice and twice[0]}")

            # The port is taken (any local user may take one first): a second
            # daemon says so in its log and lends all the same.
            with open(os.path.join(folder, "log3"), "w") as log:
                second = subprocess.Popen([SHOAL, "daemon", "--socket", f"{folder}/e.sock", "--device", "host",
                                           "--metrics-port", str(port)], stderr=log)
                until = time.monotonic() + 5
                while time.monotonic() < until and "metrics_unavailable" not in open(log.name).read():
                    time.sleep(0.05)
                try:
                    served = subprocess.run([SHOAL, "daemon", "status", "--socket", f"{folder}/e.sock", "--device",
                                             "host", "--timeout", "3"], capture_output=True, text=True, timeout=10)
                    second.send_signal(signal.SIGTERM)
                    check(second.wait(5) == 0, "the second daemon did not exit 0 after SIGTERM")
                finally:
                    if second.poll() is None:
                        second.kill()
                        second.wait()
            said = open(os.path.join(folder, "log3")).read()
            check(f"cannot listen on 127.0.0.1:{port}" in said and "metrics=unavailable" in said,
                  "the second daemon's log does not name the taken address: " + said)
            check(served.returncode == 0 and "shoal_lending_capacity_bytes" in served.stdout,
                  "the second daemon did not serve: " + served.stderr)
            bad = subprocess.run([SHOAL, "daemon", "--socket", f"{folder}/e.sock", "--device", "host",
                                  "--metrics-port", "70000"], capture_output=True, text=True, timeout=10)
            check(bad.returncode == 2, f"--metrics-port 70000 exited {bad.returncode}")
        except AssertionError:
            print(open(daemon.log_path).read())
            raise
        finally:
            if daemon.process.poll() is None:
                daemon.stop()
        # Off by default: no metrics address in the log.
        with open(os.path.join(folder, "log2"), "w") as log:
            plain = subprocess.Popen([SHOAL, "daemon", "--device", "host", "--socket", f"{folder}/f.sock"], stderr=log)
            time.sleep(0.5)
            plain.send_signal(signal.SIGTERM)
            check(plain.wait(5) == 0, "the daemon without an endpoint did not exit 0")
        check("metrics=off" in open(os.path.join(folder, "log2")).read(), "the endpoint is not off by default")
    print(f"metrics_http: {checks} passed, 0 failed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}")
        print(f"metrics_http: {checks} passed, 1 failed")
        sys.exit(1)
