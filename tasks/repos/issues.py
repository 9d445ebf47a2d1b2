"""The issues a commit message links, and their text: the title and body of `#12`,
`fixes #12`, `org/repo#12` or `https://github.com/org/repo/issues/12` (or `/pull/12`), read
from GitHub's REST API (`GET {api}/repos/{owner}/{repo}/issues/{n}`, which answers for pull
requests too) or from a local export (JSON lines of `{number, title, body}`).

A lookup never fails a mine: an issue whose text cannot be had is a `Missing` with why, which
the case's metadata records; the problem statement then holds the message alone for it.

What a history or a server says is not trusted: only the mined repository's issues are asked
for (unless the user allows others'), at most `MAX_REFS` a message and `MAX_LOOKUPS` a mine;
an answer is checked for shape and depth before it is cached, under a hashed name; the token
goes to the API's own origin only (a redirect elsewhere is not followed), and plain http
only to this machine's loopback.
"""

from __future__ import annotations

import hashlib
import http.client
import ipaddress
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from tasks.errors import InputError
from tasks.files import atomic_write
from tasks.repos.worktrees import RepoError, is_url, run_git

DEFAULT_API = "https://api.github.com"
# Per request (connect, then each read): a slow API costs a mine this much per issue, once.
TIMEOUT_S = 10.0
# The most of an issue body a case keeps: a problem statement, not a thread's attachments.
BODY_CAP = 20_000
# References looked up per commit message, and answers asked of the API per mine (cached
# ones are free): a history can link thousands (`#1 #2 ... #99999`).
MAX_REFS = 20
MAX_LOOKUPS = 1000
_OWNER_NAME = re.compile(r"(?!\.\.?/)[\w.-]+/(?!\.\.?$)[\w.-]+")
_REF = re.compile(
    r"https?://[\w.-]+/(?P<url_owner>[\w.-]+)/(?P<url_repo>[\w.-]+)/(?:issues|pull)/(?P<url_n>\d+)"
    r"|(?<![\w/#&])(?:(?P<owner>[\w.-]+)/(?P<repo>[\w.-]+))?#(?P<n>\d+)\b")
# owner/name at the end of a remote URL: https://host/o/n(.git), git@host:o/n.git, ssh://git@host/o/n
_REMOTE = re.compile(r"^(?:[a-z+]+://[^/]+/|[\w.-]+@[\w.-]+:)(?:.*/)?(?P<owner>[\w.-]+)/(?P<repo>[\w.-]+?)(?:\.git)?/?$")


@dataclass(frozen=True)
class IssueRef:
    """An issue a message links: its number and, when the message names one, its repository."""

    number: int
    repo: str | None = None  # "owner/name" as written; None: the mined repository's

    @property
    def label(self) -> str:
        return f"{self.repo or ''}#{self.number}"


@dataclass(frozen=True)
class Issue:
    ref: IssueRef
    title: str
    body: str
    source: str  # where the text came from: the API URL or the export file


@dataclass(frozen=True)
class Missing:
    ref: IssueRef
    why: str


def issue_refs(message: str) -> tuple[IssueRef, ...]:
    """The issues a message links, in order of first appearance, each once."""
    refs = []
    for m in _REF.finditer(message):
        if m["url_n"]:
            refs.append(IssueRef(int(m["url_n"]), f"{m['url_owner']}/{m['url_repo']}"))
        else:
            refs.append(IssueRef(int(m["n"]), f"{m['owner']}/{m['repo']}" if m["owner"] else None))
    return tuple(dict.fromkeys(refs))


def github_repo_of(remote: str) -> str | None:
    """"owner/name" from a remote URL (any host: GitHub Enterprise too), None for a path."""
    m = _REMOTE.match(remote.strip())
    return f"{m['owner']}/{m['repo']}" if m else None


def remote_of(source: str) -> str | None:
    """The URL a mined repository came from: the source itself, or a local clone's origin."""
    if is_url(source):
        return source
    try:
        return run_git(Path(source), "config", "--get", "remote.origin.url") or None
    except RepoError:
        return None


class IssueSource(Protocol):
    def lookup(self, ref: IssueRef) -> Issue | Missing: ...


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(
        parts.scheme.lower())


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _SameOrigin(urllib.request.HTTPRedirectHandler):
    """Follows a redirect within the API's origin only: urllib copies every header, the
    token too, to wherever a 3xx points (another host or port, plain http)."""

    def __init__(self, origin: tuple[str, str, int | None]) -> None:
        self.origin = origin

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        if _origin(newurl) != self.origin:
            scheme, host, port = _origin(newurl)
            raise urllib.error.HTTPError(req.full_url, code, f"redirect to another origin ({scheme}://{host}:{port})"
                                         " not followed", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _answer(doc: Any) -> dict[str, str] | None:
    """A kept answer ({title, body} or {missing}) as it must be, else None."""
    if isinstance(doc, dict) and set(doc) == {"missing"} and isinstance(doc["missing"], str):
        return doc
    if isinstance(doc, dict) and set(doc) == {"title", "body"} and all(isinstance(v, str) for v in doc.values()):
        return doc
    return None


class GitHubIssues:
    """Issues from the REST API of `api` (github.com's or an Enterprise server's), for the
    repository `repo` ("owner/name"), and another's a reference names where `other_repos`
    allows it. Answers (an issue, or a 404/410: there is none) are cached under `cache_dir`,
    so a mine run again asks nothing twice; failures (unreachable, a timeout, a rate limit)
    are not, and are tried next time. Once the API is unreachable, the rest of this source's
    lookups give the same reason without waiting on it again. At most `max_lookups` answers
    are asked for."""

    def __init__(self, api: str, repo: str, cache_dir: Path, token: str | None = None,
                 timeout_s: float = TIMEOUT_S, *, other_repos: bool = False, max_lookups: int = MAX_LOOKUPS) -> None:
        self.api, self.repo, self.cache_dir = api.rstrip("/"), repo, cache_dir
        self.token, self.timeout_s = token, timeout_s
        self.other_repos, self.max_lookups, self.asked = other_repos, max_lookups, 0
        self.unreachable: str | None = None
        self._opener = urllib.request.build_opener(_SameOrigin(_origin(self.api)))

    def url(self, ref: IssueRef) -> str:
        return f"{self.api}/repos/{ref.repo or self.repo}/issues/{ref.number}"

    def lookup(self, ref: IssueRef) -> Issue | Missing:
        try:
            return self._lookup(ref)
        except Exception as exc:  # a lookup never fails a mine, whatever the server or the disk did
            return Missing(ref, f"{self.url(ref)}: {type(exc).__name__}: {exc}")

    def _lookup(self, ref: IssueRef) -> Issue | Missing:
        if ref.repo is not None and ref.repo.lower() != self.repo.lower():
            if not self.other_repos:
                return Missing(ref, f"{ref.label} is another repository's issue: not fetched"
                                    " (--issues-from-other-repos fetches it)")
            if not _OWNER_NAME.fullmatch(ref.repo):
                return Missing(ref, f"{ref.label}: not a repository name")
        url = self.url(ref)
        cached = self._cached(url)
        if cached is None:
            if self.unreachable:
                return Missing(ref, self.unreachable)
            if self.asked >= self.max_lookups:
                return Missing(ref, f"over the {self.max_lookups} issues a mine may ask the API for: not asked")
            self.asked += 1
            answer = self._get(url)
            if isinstance(answer, str):
                return Missing(ref, answer)
            self._cache(url, answer)
            cached = answer
        if "missing" in cached:
            return Missing(ref, cached["missing"])
        return Issue(ref, cached["title"], cached["body"], url)

    def _get(self, url: str) -> dict | str:
        """The answer to keep ({title, body} or {missing}), or why there is none (a str)."""
        headers = {"Accept": "application/vnd.github+json", "User-Agent": "evalpipe-mine",
                   "X-GitHub-Api-Version": "2022-11-28"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            with self._opener.open(urllib.request.Request(url, headers=headers), timeout=self.timeout_s) as response:
                doc = json.loads(response.read(4 << 20))
        except urllib.error.HTTPError as exc:
            if exc.code in (404, 410):
                return {"missing": f"{url}: HTTP {exc.code} (no such issue, or not visible with this token)"}
            return f"{url}: HTTP {exc.code} {exc.reason}" + (" (rate limit or token: set GITHUB_TOKEN)"
                                                            if exc.code in (401, 403, 429) else "")
        except (urllib.error.URLError, OSError) as exc:
            self.unreachable = f"{self.api} unreachable: {getattr(exc, 'reason', exc)}"
            return self.unreachable
        except http.client.HTTPException as exc:  # an answer cut short, a status line too long
            return f"{url}: {type(exc).__name__}: {exc}"
        except RecursionError:
            return f"{url}: the answer is nested too deeply"
        except ValueError:
            return f"{url}: the answer is not JSON"
        if not isinstance(doc, dict) or not isinstance(doc.get("title"), str):
            return f"{url}: the answer has no issue title"
        if not isinstance(doc.get("body"), str | None):
            return f"{url}: the answer's body is a {type(doc['body']).__name__}, not text"
        return {"title": doc["title"], "body": doc.get("body") or ""}

    def _path(self, url: str) -> Path:
        # Hashed: a URL from a commit message may be longer than a file name may be.
        return self.cache_dir / f"{hashlib.sha256(url.encode()).hexdigest()}.json"

    def _cached(self, url: str) -> dict | None:
        """The kept answer, or None (none, unreadable, or of another shape: asked again)."""
        try:
            return _answer(json.loads(self._path(url).read_text(encoding="utf-8")))
        except (OSError, ValueError, RecursionError):
            return None

    def _cache(self, url: str, answer: dict) -> None:
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self._path(url), json.dumps(answer))
        except OSError:  # noqa: S110 - not kept, only asked again next time
            pass


class IssueFile:
    """Issues from an export of the mined repository's: JSON lines of {number, title, body}.
    A reference to another repository (`org/repo#12`) is not in it."""

    def __init__(self, path: Path, repo: str | None = None) -> None:
        self.path, self.repo = path, repo
        self.issues: dict[int, tuple[str, str]] = {}
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"--issues {path}: cannot be read: {exc}") from exc
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except ValueError as exc:
                raise InputError(f"--issues {path}, line {number}: not JSON ({exc})") from None
            except RecursionError:
                raise InputError(f"--issues {path}, line {number}: nested too deeply") from None
            if not (isinstance(doc, dict) and isinstance(doc.get("number"), int) and isinstance(doc.get("title"), str)
                    and isinstance(doc.get("body", ""), str | None)):
                raise InputError(f"--issues {path}, line {number}: expected {{number: int, title: str, body: str}}")
            self.issues[doc["number"]] = (doc["title"], doc.get("body") or "")

    def lookup(self, ref: IssueRef) -> Issue | Missing:
        if ref.repo is not None and ref.repo != self.repo:
            return Missing(ref, f"{ref.label} is another repository's; {self.path} holds this one's")
        if ref.number not in self.issues:
            return Missing(ref, f"#{ref.number} is not in {self.path}")
        title, body = self.issues[ref.number]
        return Issue(ref, title, body, str(self.path))


def linked_text(message: str, source: IssueSource | None) -> tuple[str, list[dict]]:
    """The problem statement (the message, then each linked issue's title and body) and what
    became of each linked issue, for the case's metadata: `{issue, source, title}` or
    `{issue, not_fetched: why}`."""
    found: list[Issue] = []
    record: list[dict] = []
    refs = issue_refs(message)
    for ref in refs[:MAX_REFS]:
        got = Missing(ref, "no issue source given (--issues)") if source is None else source.lookup(ref)
        if isinstance(got, Issue):
            found.append(got)
            record.append({"issue": ref.label, "source": got.source, "title": got.title})
        else:
            record.append({"issue": ref.label, "not_fetched": got.why})
    if len(refs) > MAX_REFS:
        record.append({"issue": f"{len(refs) - MAX_REFS} more", "not_fetched":
                       f"over the {MAX_REFS} issues a message may link: not looked up"})
    return _statement(message, found), record


def _statement(message: str, issues: Iterable[Issue]) -> str:
    parts = [message]
    for issue in issues:
        body = issue.body.strip()
        if len(body) > BODY_CAP:
            body = body[:BODY_CAP] + f"\n[... {len(issue.body) - BODY_CAP} more characters]"
        parts.append(f"Issue {issue.ref.label}: {issue.title.strip()}" + (f"\n\n{body}" if body else ""))
    return "\n\n".join(parts)


def issue_source(issues: str | None, source: str, *, api: str = DEFAULT_API, github_repo: str | None = None,
                 cache_dir: Path, token: str | None = None, other_repos: bool = False) -> IssueSource | None:
    """What `--issues` names: `github` (the REST API at `api`, for `github_repo` or the one
    the repository's remote URL names; other repositories' issues too with `other_repos`), a
    JSON-lines export, or nothing (None). Raises `InputError` for a source that cannot be
    used, before anything is mined."""
    if github_repo is not None and not _OWNER_NAME.fullmatch(github_repo):
        raise InputError(f"--github-repo {github_repo!r}: expected OWNER/NAME")
    if issues is None:
        return None
    remote = remote_of(source)
    name = github_repo or (github_repo_of(remote) if remote else None)
    if issues != "github":
        return IssueFile(Path(issues), name)
    if not re.match(r"https?://[^/]+", api):
        raise InputError(f"--github-api {api!r}: expected an http(s) URL")
    scheme, host, _ = _origin(api)
    if scheme == "http" and not is_loopback(host):
        raise InputError(f"--github-api {api!r}: plain http only to this machine's loopback (the token and the"
                         " answers would cross the network in the clear); use https")
    if name is not None and not _OWNER_NAME.fullmatch(name):
        raise InputError(f"--issues github: {name!r} (from {remote}) is not OWNER/NAME; give --github-repo")
    if name is None:
        raise InputError(f"--issues github: {source} has no remote URL naming OWNER/NAME"
                         f" ({remote or 'no origin'}); give --github-repo OWNER/NAME")
    return GitHubIssues(api, name, cache_dir, token, other_repos=other_repos)
