"""Headless Chromium (Debian's chromium + chromium-driver, installed by `make browser`) driven by
Selenium, for the console's browser tests. No browser or driver is downloaded: both paths are the
system's. Screenshots go to tests/artifacts/ (git-ignored), kept after the run."""

from __future__ import annotations

import time
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).parent / "artifacts"


def start_browser(download_dir: Path, width: int = 1400, height: int = 1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.add_experimental_option("prefs", {"download.default_directory": str(download_dir),
                                              "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    return driver


class Console:
    """One browser tab on the console, logged in with one key."""

    def __init__(self, driver, base_url: str):
        self.driver, self.base_url = driver, base_url

    def login(self, key: str) -> None:
        from selenium.webdriver.common.by import By

        self.driver.get(f"{self.base_url}/console/")
        self.driver.execute_script("sessionStorage.clear(); location.hash = '#/runs'")
        self.driver.refresh()  # a fresh page: logged out
        self.wait(lambda: self.driver.find_element(By.ID, "login").is_displayed())
        self.driver.find_element(By.ID, "login-key").send_keys(key)
        self.driver.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
        self.wait(lambda: self.driver.find_elements(By.CSS_SELECTOR, "#view[data-page=runs]"))

    def open(self, hash_path: str, page: str):
        """Go to ``#/<hash_path>`` and wait until the view ``page`` (or an error) is drawn."""
        from selenium.webdriver.common.by import By

        self.driver.execute_script("location.hash = arguments[0]", f"#/{hash_path}")
        self.wait(lambda: self.driver.find_elements(By.CSS_SELECTOR, f"#view[data-page={page}]")
                  or self.driver.find_elements(By.CSS_SELECTOR, "#page > .error"))
        errors = self.driver.find_elements(By.CSS_SELECTOR, "#page > .error")
        return errors[0].text if errors else None

    def text(self) -> str:
        return self.driver.find_element("id", "page").text

    def wait(self, predicate, timeout: float = 60.0, what: str = "the page"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                value = predicate()
            except Exception:  # noqa: BLE001 - the element is not there yet
                value = None
            if value:
                return value
            time.sleep(0.1)
        self.screenshot("timeout")
        raise AssertionError(f"timed out waiting for {what}; page text: {self.driver.find_element('tag name', 'body').text[:2000]}")

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.driver.save_screenshot(str(path))
        return path
