// Course pages: section navigation, the phone menu, and remote pictures only when online.
// Everything here is local; the page makes no network request unless a remote image is
// shown while the browser says it is online.
(function () {
  "use strict";

  var sections = Array.prototype.slice.call(document.querySelectorAll("main section.section[id]"));
  var tocLinks = {};
  Array.prototype.forEach.call(document.querySelectorAll(".toc a[href^='#']"), function (a) {
    tocLinks[a.getAttribute("href").slice(1)] = a;
  });

  // --- which section is being read ---------------------------------------------------
  function offset() {
    var bar = document.querySelector(".topbar");
    return (bar && bar.offsetHeight) || 0;
  }
  function currentIndex() {
    var limit = offset() + 60, idx = -1;
    for (var i = 0; i < sections.length; i++) {
      if (sections[i].getBoundingClientRect().top <= limit) idx = i; else break;
    }
    return idx;
  }
  function markActive() {
    var idx = currentIndex();
    var id = idx >= 0 ? sections[idx].id : null;
    Object.keys(tocLinks).forEach(function (k) {
      tocLinks[k].classList.toggle("active", k === id);
    });
  }
  var pending = false;
  window.addEventListener("scroll", function () {
    if (pending) return;
    pending = true;
    window.requestAnimationFrame(function () { pending = false; markActive(); });
  }, { passive: true });
  window.addEventListener("hashchange", markActive);

  var lastGo = -1;
  function here() {
    // a short last section cannot reach the top of the window: remember where we went
    var atBottom = window.innerHeight + window.scrollY >= document.documentElement.scrollHeight - 2;
    return Math.max(currentIndex(), atBottom ? lastGo : -1);
  }
  function go(idx) {
    lastGo = Math.max(-1, Math.min(idx, sections.length - 1));
    if (idx < 0) {
      // before the first section: the top of the page
      if (history.replaceState) history.replaceState(null, "", "#top");
      window.scrollTo({ top: 0, behavior: "instant" });
      markActive();
      return;
    }
    idx = Math.min(idx, sections.length - 1);
    var s = sections[idx];
    if (!s) return;
    // jump at once (keys are for moving fast), and put the section in the address bar
    s.scrollIntoView({ behavior: "instant", block: "start" });
    if (history.replaceState) history.replaceState(null, "", "#" + s.id);
    else location.hash = s.id;
    setActive(s.id);
  }
  function setActive(id) {
    Object.keys(tocLinks).forEach(function (k) { tocLinks[k].classList.toggle("active", k === id); });
  }

  // --- phone menu -----------------------------------------------------------------------
  var menu = document.getElementById("menu");
  function setMenu(open) {
    document.body.classList.toggle("menu-open", open);
    if (menu) menu.setAttribute("aria-expanded", open ? "true" : "false");
  }
  if (menu) {
    menu.addEventListener("click", function (e) {
      e.stopPropagation();
      setMenu(!document.body.classList.contains("menu-open"));
    });
  }
  document.addEventListener("click", function (e) {
    if (!document.body.classList.contains("menu-open")) return;
    var sidebar = document.getElementById("sidebar");
    var link = e.target.closest ? e.target.closest("a") : null;
    if (!sidebar.contains(e.target) || link) setMenu(false);
  });
  Object.keys(tocLinks).forEach(function (k) {
    tocLinks[k].addEventListener("click", function () { setActive(k); });
  });

  // --- keyboard -------------------------------------------------------------------------
  document.addEventListener("keydown", function (e) {
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    var t = e.target;
    if (t && (t.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(t.tagName))) return;
    var k = e.key;
    if (k === "j" || k === "n" || k === "ArrowRight") { go(here() + 1); e.preventDefault(); }
    else if (k === "k" || k === "p" || k === "ArrowLeft") { go(here() - 1); e.preventDefault(); }
    else if (k === "t") {
      var toc = document.getElementById("toc");
      if (window.matchMedia("(max-width: 800px)").matches) setMenu(true);
      var first = toc && toc.querySelector("a");
      if (first) first.focus();
      e.preventDefault();
    } else if (k === "Escape") setMenu(false);
  });

  // --- remote images: a link card offline; the picture only when online and it loads -------
  if (navigator.onLine) {
    Array.prototype.forEach.call(document.querySelectorAll("figure.remote[data-src]"), function (fig) {
      var img = new Image();
      img.alt = fig.getAttribute("data-alt") || "";
      var w = fig.getAttribute("data-width");
      if (w) img.width = parseInt(w, 10);
      img.referrerPolicy = "no-referrer";
      img.onload = function () {
        fig.insertBefore(img, fig.firstChild);  // shown only once loaded: never a broken icon
        fig.classList.add("online");
      };
      img.onerror = function () { fig.classList.remove("online"); };
      img.src = fig.getAttribute("data-src");
    });
  }

  // --- long code listings fold after ~25 lines; the reader opens what they want ---------
  document.documentElement.classList.add("js");
  Array.prototype.forEach.call(document.querySelectorAll("figure.code.long"), function (fig) {
    var lines = fig.querySelectorAll(".line").length;
    var button = document.createElement("button");
    button.type = "button";
    button.className = "fold-toggle";
    function set(folded) {
      fig.classList.toggle("folded", folded);
      button.textContent = folded ? "show all " + lines + " lines" : "fold";
      button.setAttribute("aria-expanded", folded ? "false" : "true");
    }
    button.addEventListener("click", function () { set(!fig.classList.contains("folded")); });
    fig.appendChild(button);
    set(true);
  });

  markActive();
})();
