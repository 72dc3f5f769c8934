"""A small HTTP client for the native API (stdlib only), used by `pagedbatch submit|status|wait|download`."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

TERMINAL = ("completed", "failed", "expired", "cancelled")


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str):
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = body[:500]
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class Unreachable(ConnectionError):
    """No answer from the API: nothing listens there, the name does not resolve, or it timed out."""

    def __init__(self, base_url: str, reason: object):
        super().__init__(f"cannot reach the API at {base_url}: {reason}")
        self.base_url, self.reason = base_url, reason


class _ProgressReader:
    """A file wrapper that advances a tqdm bar as it is read (the bar starts with the first read, so that
    a server that cannot be reached shows none)."""

    def __init__(self, f, enabled: bool, total: int):
        self.f, self.enabled, self.total, self.bar = f, enabled, total, None

    def read(self, size=-1):
        data = self.f.read(size)
        if self.enabled and self.bar is None:
            self.bar = _bar(True, self.total, "upload", "B")
            self.enabled = self.bar is not None
        if self.bar is not None:
            self.bar.update(len(data))
        return data

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Client:
    def __init__(self, base_url: str, timeout: float = 600, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key

    def _open(self, method: str, path: str, *, data=None, headers=None, params=None):
        url = self.base_url + path
        if params:
            url += "?" + urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        headers = dict(headers or {})
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")) from None
        except urllib.error.URLError as exc:
            raise Unreachable(self.base_url, getattr(exc.reason, "strerror", None) or exc.reason) from None
        except (ConnectionError, TimeoutError) as exc:
            raise Unreachable(self.base_url, exc.strerror or exc) from None

    def _json(self, method: str, path: str, **kwargs) -> dict:
        with self._open(method, path, **kwargs) as response:
            return json.loads(response.read())

    def submit(
        self, path, *, model: str, defaults=None, metadata=None, progress: bool = False, dry_run: bool = False
    ) -> dict:
        """Upload a JSONL file (streamed as an application/x-ndjson body) as a job; with `dry_run`, its quote
        (nothing is created or run)."""
        size = os.path.getsize(path)
        params = {
            "model": model,
            "defaults": json.dumps(defaults) if defaults else None,
            "metadata": json.dumps(metadata) if metadata else None,
            "dry_run": "true" if dry_run else None,
        }
        with open(path, "rb") as f:
            reader = _ProgressReader(f, progress, size)
            try:
                return self._json(
                    "POST",
                    "/v1/jobs",
                    data=reader,
                    params=params,
                    headers={"Content-Type": "application/x-ndjson", "Content-Length": str(size)},
                )
            finally:
                reader.close()

    def job(self, job_id: str) -> dict:
        return self._json("GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict:
        return self._json("POST", f"/v1/jobs/{job_id}/cancel")

    def jobs(self, *, limit: int = 20, status: str | None = None, after: str | None = None) -> dict:
        """A page of the tenant's jobs, newest first (the API's list object)."""
        return self._json("GET", "/v1/jobs", params={"limit": limit, "status": status, "after": after})

    def webhook_endpoints(self) -> list[dict]:
        return self._json("GET", "/v1/webhook_endpoints", params={"limit": 100})["data"]

    def webhook_deliveries(self, endpoint_id: str, *, limit: int = 20) -> list[dict]:
        """The endpoint's delivery log, newest first."""
        return self._json("GET", f"/v1/webhook_endpoints/{endpoint_id}/deliveries", params={"limit": limit})["data"]

    def error_lines(self, job_id: str):
        """The job's OpenAI-style error lines, as parsed JSON objects, streamed (the request is made now)."""
        response = self._open("GET", f"/v1/jobs/{job_id}/errors")

        def lines():
            with response:
                for line in response:
                    if line.strip():
                        yield json.loads(line)

        return lines()

    def wait(self, job_id: str, *, timeout: float | None = None, poll_s: float = 0.5, progress: bool = False):
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self.job(job_id)
        from workers.progress_bar import RequestBar

        bar = RequestBar(job["request_counts"]["valid"], progress)
        try:
            while job["status"] not in TERMINAL:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} is still {job['status']} after {timeout}s")
                time.sleep(poll_s)
                job = self.job(job_id)
                finished = int(job["progress"] * job["request_counts"]["valid"])
                tokens = (job.get("usage") or {}).get("completion_tokens") or 0
                bar.set(finished, tokens, job.get("status_detail") or "")  # with why it waits
            bar.set(job["request_counts"]["valid"], (job.get("usage") or {}).get("completion_tokens") or 0)
        finally:
            bar.close()
        return job

    def download(
        self, job_id: str, output, *, fmt: str = "parquet", errors: bool = False, progress: bool = False
    ) -> Path:
        path = f"/v1/jobs/{job_id}/errors" if errors else f"/v1/jobs/{job_id}/results"
        output = Path(output)
        tmp = output.with_name(output.name + ".part")
        with self._open("GET", path, params=None if errors else {"format": fmt}) as response:
            total = int(response.headers.get("Content-Length") or 0) or None
            bar = _bar(progress, total, "download", "B")
            with open(tmp, "wb") as f:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            if bar is not None:
                bar.close()
        tmp.replace(output)
        return output


def _bar(enabled: bool, total, desc: str, unit: str):
    if not enabled or not sys.stderr.isatty():  # piped or redirected: no bar
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", leave=True)
