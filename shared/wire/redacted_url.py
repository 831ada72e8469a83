"""A Redis URL as logs and errors may show it: its passwords hidden. No redis-py here: configs say a URL
in their one-line errors wherever they are read (``kvrelay --help``, ``--print-config``), which need no client."""

from urllib.parse import urlsplit, urlunsplit


def redact(url: str) -> str:
    """The URL without its passwords, for logs: ``redis://gateway:***@host:6379/0``; a query option
    naming a password (a Sentinel URL's ``sentinel_password``) is hidden too."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL we can take apart: it may still hold a password
        return "<unparsable URL>"
    if password is not None:
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}")
    if "password" in parts.query.lower():
        parts = parts._replace(query="&".join(
            f"{name}=***" if "password" in name.lower() else f"{name}{sep}{value}"
            for name, sep, value in (item.partition("=") for item in parts.query.split("&"))))
    return urlunsplit(parts)
