"""MkDocs hook: a 404 page that works wherever the site is put.

MkDocs writes ``404.html`` with links from the domain root (``/assets/...``) when
``site_url`` is unset, since a server shows that page for any missing address. Served from
a sub-path, or opened from disk, those links miss. So:

* with ``site_url`` set (``ARRAYATTN_SITE_URL=https://host/path/`` when building, see
  ``mkdocs.yml``) MkDocs' absolute links already carry the sub-path: nothing to do;
* without it the page's links become relative to the site's root folder, where
  ``404.html`` itself lies: right from disk and for a missing page in the top folder of
  the site under any sub-path (a missing page deeper down needs ``site_url``).
"""

from __future__ import annotations

import re
from pathlib import Path

_ABSOLUTE = re.compile(r'(\s(?:href|src)=")/(?!/)')


def on_post_build(config):
    if config.get("site_url"):
        return
    page = Path(config["site_dir"]) / "404.html"
    if not page.is_file():
        return
    html = _ABSOLUTE.sub(r"\1", page.read_text(encoding="utf-8"))
    html = html.replace('"base": "/"', '"base": "."')
    page.write_text(html, encoding="utf-8")
