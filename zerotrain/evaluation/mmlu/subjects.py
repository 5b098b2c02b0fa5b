"""The 57 MMLU subjects and their categories.

The subject -> category map is the one of Hendrycks et al. (2021), as used by
lm-evaluation-harness' ``mmlu`` task groups (``mmlu_stem``, ``mmlu_humanities``,
``mmlu_social_sciences``, ``mmlu_other``), so per-category numbers are
comparable with theirs.
"""

from __future__ import annotations

import difflib
from typing import Iterable

from zerotrain.evaluation.errors import UnknownSubjectError

STEM = "stem"
HUMANITIES = "humanities"
SOCIAL_SCIENCES = "social_sciences"
OTHER = "other"

CATEGORIES: tuple[str, ...] = (STEM, HUMANITIES, SOCIAL_SCIENCES, OTHER)

SUBJECT_CATEGORIES: dict[str, str] = {
    "abstract_algebra": STEM,
    "anatomy": STEM,
    "astronomy": STEM,
    "business_ethics": OTHER,
    "clinical_knowledge": OTHER,
    "college_biology": STEM,
    "college_chemistry": STEM,
    "college_computer_science": STEM,
    "college_mathematics": STEM,
    "college_medicine": OTHER,
    "college_physics": STEM,
    "computer_security": STEM,
    "conceptual_physics": STEM,
    "econometrics": SOCIAL_SCIENCES,
    "electrical_engineering": STEM,
    "elementary_mathematics": STEM,
    "formal_logic": HUMANITIES,
    "global_facts": OTHER,
    "high_school_biology": STEM,
    "high_school_chemistry": STEM,
    "high_school_computer_science": STEM,
    "high_school_european_history": HUMANITIES,
    "high_school_geography": SOCIAL_SCIENCES,
    "high_school_government_and_politics": SOCIAL_SCIENCES,
    "high_school_macroeconomics": SOCIAL_SCIENCES,
    "high_school_mathematics": STEM,
    "high_school_microeconomics": SOCIAL_SCIENCES,
    "high_school_physics": STEM,
    "high_school_psychology": SOCIAL_SCIENCES,
    "high_school_statistics": STEM,
    "high_school_us_history": HUMANITIES,
    "high_school_world_history": HUMANITIES,
    "human_aging": OTHER,
    "human_sexuality": SOCIAL_SCIENCES,
    "international_law": HUMANITIES,
    "jurisprudence": HUMANITIES,
    "logical_fallacies": HUMANITIES,
    "machine_learning": STEM,
    "management": OTHER,
    "marketing": OTHER,
    "medical_genetics": OTHER,
    "miscellaneous": OTHER,
    "moral_disputes": HUMANITIES,
    "moral_scenarios": HUMANITIES,
    "nutrition": OTHER,
    "philosophy": HUMANITIES,
    "prehistory": HUMANITIES,
    "professional_accounting": OTHER,
    "professional_law": HUMANITIES,
    "professional_medicine": OTHER,
    "professional_psychology": SOCIAL_SCIENCES,
    "public_relations": SOCIAL_SCIENCES,
    "security_studies": SOCIAL_SCIENCES,
    "sociology": SOCIAL_SCIENCES,
    "us_foreign_policy": SOCIAL_SCIENCES,
    "virology": OTHER,
    "world_religions": HUMANITIES,
}

SUBJECTS: tuple[str, ...] = tuple(sorted(SUBJECT_CATEGORIES))


def close_matches(name: str, candidates: Iterable[str], n: int = 5) -> list[str]:
    """Candidates that look like ``name`` (typos, missing prefixes, spaces)."""
    candidates = list(candidates)
    key = normalise_subject(name)
    found = difflib.get_close_matches(key, candidates, n=n, cutoff=0.6)
    # difflib misses "physics" -> "college_physics"; substring hits help there.
    found += [c for c in candidates if key and key in c and c not in found]
    return found[:n]


def normalise_subject(name: str) -> str:
    """Accept "High School Physics" / "high-school-physics" for high_school_physics."""
    return "_".join(name.strip().lower().replace("-", " ").split())


def check_subject(name: str, *, where: str = "") -> str:
    """Return the canonical subject name or raise UnknownSubjectError naming close matches."""
    key = normalise_subject(name)
    if key in SUBJECT_CATEGORIES:
        return key
    hint = close_matches(name, SUBJECTS)
    suggestion = f" Did you mean: {', '.join(hint)}?" if hint else ""
    location = f" ({where})" if where else ""
    raise UnknownSubjectError(
        f"unknown MMLU subject {name!r}{location}.{suggestion} "
        f"Valid subjects are the 57 of cais/mmlu: {', '.join(SUBJECTS)}"
    )


def subject_category(subject: str) -> str:
    """The category (stem, humanities, social_sciences, other) of a canonical subject."""
    return SUBJECT_CATEGORIES[subject]


def subject_description(subject: str) -> str:
    """The subject as it appears in the prompt header: underscores become spaces."""
    return subject.replace("_", " ")
