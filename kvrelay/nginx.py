"""nginx in front of local gateways: the shipped deploy/nginx/nginx.conf itself, with only its marked
upstream and listen lines pointed at loopback and its pid, logs and temp files moved into a work
directory (timeouts, failover and buffering stay as shipped). What the nginx benchmark and the nginx
end-to-end tests run, so both exercise the production configuration."""

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

NGINX_CONF = Path(__file__).parents[1] / "deploy" / "nginx" / "nginx.conf"  # in the repository, beside kvrelay/


def loopback_nginx_config(gateway_ports: list[int], listen_port: int, workdir: Path, conf: Path = NGINX_CONF) -> str:
    text = conf.read_text()
    upstream = [line for line in text.splitlines() if line.strip().endswith("# kvrelay:upstream")]
    if not upstream:
        raise ValueError(f"{conf} has no line marked '# kvrelay:upstream'")
    params = re.search(r"server \S+ (.*);", upstream[0]).group(1)
    servers = "\n".join(f"        server 127.0.0.1:{p} {params};" for p in gateway_ports)
    text = text.replace(upstream[0], servers)
    for line in upstream[1:]:
        text = text.replace(line + "\n", "")
    text = re.sub(r"listen 80;\s*# kvrelay:listen", f"listen 127.0.0.1:{listen_port};", text)
    text = text.replace("pid /var/run/nginx.pid;", f"pid {workdir}/nginx.pid;")
    text = text.replace("access_log /dev/stdout kvrelay;", f"access_log {workdir}/access.log kvrelay;")
    temp = "\n".join(f"    {kind}_temp_path {workdir}/{kind};" for kind in
                     ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return text.replace("http {\n", "http {\n" + temp + "\n", 1)


@contextlib.contextmanager
def loopback_nginx(binary: str, gateway_ports: list[int], listen_port: int, workdir: Path,
                   log: Path) -> Iterator[subprocess.Popen]:
    """nginx running that configuration in the foreground (checked with ``nginx -t`` first); stopped
    gracefully (SIGQUIT) on exit."""
    workdir.mkdir(mode=0o777, parents=True, exist_ok=True)
    os.chmod(workdir, 0o777)  # nginx workers run as nobody under a root master
    conf = workdir / "nginx.conf"
    conf.write_text(loopback_nginx_config(gateway_ports, listen_port, workdir))
    base = [binary, "-c", str(conf), "-p", str(workdir), "-e", "stderr"]
    check = subprocess.run([*base, "-t", "-q"], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"nginx rejects {conf}: {check.stderr}")
    with open(log, "wb") as out:
        proc = subprocess.Popen([*base, "-g", "daemon off;"], stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGQUIT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
