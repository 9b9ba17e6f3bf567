"""A real headless browser for the dashboard's tests: Debian's chromium, driven through its
chromedriver with selenium (DEPENDENCIES.md: the Makefile's test packages install both).

Selenium blocks while the browser works, and the pool under test runs on the test's own event
loop: every call goes through a thread (`asyncio.to_thread`), or the page would wait for a
server that waits for the page. `host_rules` maps made-up names to loopback inside this browser
alone (chromium's --host-resolver-rules): how a test plays a DNS-rebinding site with no DNS.
Screenshots land in test-artefacts/screenshots/ (left in the working tree; git ignores it).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-artefacts" / "screenshots"


def need_browser() -> None:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        pytest.skip(
            f"no headless browser ({', '.join(missing)} missing): `make test` installs Debian's chromium and "
            "chromium-driver when it runs as root with apt-get"
        )
    if shutil.which("chromium") is None and not Path(CHROMIUM).exists():
        pytest.skip("chromium is not on PATH")


class Browser:
    """One browser window with its own profile (cookies are its own)."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), 60)

    async def get(self, url: str) -> None:
        await self.call(self.driver.get, url)

    async def text(self, css: str) -> str:
        """The visible text of the first element `css` finds ("" if none)."""

        # Read in the page in one step: a live block replaced between a find and a read of its
        # element would leave a stale reference.
        script = "const e = document.querySelector(arguments[0]); return e ? e.innerText : '';"
        return str(await self.call(self.driver.execute_script, script, css))

    async def exists(self, css: str) -> bool:
        script = "return document.querySelector(arguments[0]) !== null;"
        return bool(await self.call(self.driver.execute_script, script, css))

    async def page_text(self) -> str:
        return str(await self.call(lambda: self.driver.find_element("tag name", "body").text))

    async def fill(self, css: str, value: str) -> None:
        await self.call(lambda: self.driver.find_element("css selector", css).send_keys(value))

    async def click(self, css: str) -> None:
        await self.call(lambda: self.driver.find_element("css selector", css).click())

    async def url(self) -> str:
        return str(await self.call(lambda: self.driver.current_url))

    async def wait_text(self, css: str, wanted: str, timeout: float = 20.0) -> str:
        """Wait until the element `css` shows `wanted` (a substring) without any reload by the test."""
        deadline = time.monotonic() + timeout
        seen = ""
        while time.monotonic() < deadline:
            seen = await self.text(css)
            if wanted in seen:
                return seen
            await asyncio.sleep(0.1)
        page = (await self.page_text())[:2000]
        raise AssertionError(
            f"{css} never showed {wanted!r} in {timeout} s; it shows {seen!r}; at {await self.url()}: {page}"
        )

    async def wait_exists(self, css: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not await self.exists(css):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {css} in {timeout} s at {await self.url()}")
            await asyncio.sleep(0.1)

    async def screenshot(self, name: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        await self.call(self.driver.save_screenshot, str(path))
        return path


@asynccontextmanager
async def browser(host_rules: str = "") -> AsyncIterator[Browser]:
    need_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
    ):
        options.add_argument(arg)
    if host_rules:
        options.add_argument(f"--host-resolver-rules={host_rules}")
    driver = await asyncio.wait_for(
        asyncio.to_thread(webdriver.Chrome, options=options, service=Service(CHROMEDRIVER)), 60
    )
    try:
        yield Browser(driver)
    finally:
        await asyncio.wait_for(asyncio.to_thread(driver.quit), 30)
