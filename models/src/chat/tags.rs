//! The block tags of a chat template's source (`{% ... %}`), found as minijinja's lexer finds
//! them: outside comments, `{{ ... }}` and `{% raw %}` blocks, each ending at the first `%}`
//! outside a string literal. The template's two rewrites before it compiles go through them:
//! `{% generation %}` blocks become a filter block, and every assignment to a namespace
//! attribute passes its value through a filter that copies it.

/// Rewrites the block tags of `source`: `rewrite` gets each tag's inside (between `{%` and
/// `%}`, whitespace controls included) and returns the inside to put in its place, or `None` to
/// keep it. Text, comments, expressions and raw blocks are copied as they are; an unclosed
/// tag, comment or expression is copied as it is too (minijinja then says what is wrong).
pub(crate) fn rewrite_tags(
    source: &str,
    mut rewrite: impl FnMut(&str) -> Option<String>,
) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find('{') {
        let (text, from) = rest.split_at(at);
        out.push_str(text);
        let copied = if from.starts_with("{#") {
            from.find("#}").map(|end| end + 2)
        } else if let Some(expression) = from.strip_prefix("{{") {
            end_outside_strings(expression, "}}").map(|end| 2 + end + 2)
        } else if let Some(inner) = from.strip_prefix("{%") {
            match end_outside_strings(inner, "%}") {
                Some(end) if is_tag(&inner[..end], "raw") => Some(
                    2 + end + 2 + end_of_raw(&inner[end + 2..]).unwrap_or(inner.len() - end - 2),
                ),
                Some(end) => {
                    let tag = &inner[..end];
                    out.push_str("{%");
                    out.push_str(&rewrite(tag).unwrap_or_else(|| tag.to_string()));
                    out.push_str("%}");
                    rest = &inner[end + 2..];
                    continue;
                }
                None => None,
            }
        } else {
            Some(1)
        };
        let len = copied.unwrap_or(from.len());
        out.push_str(&from[..len]);
        rest = &from[len..];
    }
    out.push_str(rest);
    out
}

/// Where `close` first stands in `s` outside a string literal (`'...'` or `"..."`, with
/// backslash escapes).
fn end_outside_strings(s: &str, close: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            quote @ (b'\'' | b'"') => {
                i += 1;
                while i < bytes.len() && bytes[i] != quote {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            _ if bytes[i..].starts_with(close.as_bytes()) => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// The inside of a tag without its whitespace controls (`-`, `+`) on either side: (left
/// control, body, right control).
fn split_controls(tag: &str) -> (&str, &str, &str) {
    let (left, body) = match tag.chars().next() {
        Some(c @ ('-' | '+')) => tag.split_at(c.len_utf8()),
        _ => ("", tag),
    };
    match body.chars().last() {
        Some(c @ ('-' | '+')) => {
            let (body, right) = body.split_at(body.len() - c.len_utf8());
            (left, body, right)
        }
        _ => (left, body, ""),
    }
}

/// Whether the tag's inside is the keyword `word` alone.
fn is_tag(tag: &str, word: &str) -> bool {
    split_controls(tag).1.trim() == word
}

/// The length of a raw block's rest, through its `{% endraw %}`.
fn end_of_raw(s: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(at) = s[from..].find("{%") {
        let start = from + at + 2;
        let end = start + s[start..].find("%}")?;
        if is_tag(&s[start..end], "endraw") {
            return Some(end + 2);
        }
        from = start;
    }
    None
}

/// A `{% generation %}` or `{% endgeneration %}` tag's inside: its whitespace controls and
/// whether it is the end tag.
pub(crate) fn generation_tag(tag: &str) -> Option<(&str, &str, bool)> {
    let (left, body, right) = split_controls(tag);
    let end = match body.trim() {
        "generation" => false,
        "endgeneration" => true,
        _ => return None,
    };
    Some((left, right, end))
}

/// A `{% set a.b = value %}` tag (a target with a dot: an assignment into a namespace,
/// `{% set a.b, c = x, y %}` too) rewritten as `{% set a.b = (value)|filter %}`; `None` for
/// any other tag.
pub(crate) fn filter_attribute_assignment(tag: &str, filter: &str) -> Option<String> {
    let (left, body, right) = split_controls(tag);
    let after_set = body.trim_start().strip_prefix("set")?;
    if !after_set.starts_with(char::is_whitespace) {
        return None;
    }
    let target_len = after_set
        .find(|c: char| !(c.is_alphanumeric() || c.is_whitespace() || "_.,()".contains(c)))?;
    let (target, value) = after_set.split_at(target_len);
    let value = value.strip_prefix('=')?;
    if !target.contains('.') || value.starts_with('=') {
        return None;
    }
    let head = &body[..body.len() - after_set.len()];
    Some(format!(
        "{left}{head}{target}= ({})|{filter} {right}",
        value.trim()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(source: &str) -> String {
        rewrite_tags(source, |tag| filter_attribute_assignment(tag, "f"))
    }

    #[test]
    fn only_assignments_into_attributes_are_rewritten() {
        assert_eq!(guard("{% set ns.x = 1 %}"), "{% set ns.x = (1)|f %}");
        assert_eq!(
            guard("{%- set ns.x=a ~ 'b' -%}"),
            "{%- set ns.x= (a ~ 'b')|f -%}"
        );
        assert_eq!(
            guard("{% set ns.a, b = 1, 2 %}"),
            "{% set ns.a, b = (1, 2)|f %}"
        );
        assert_eq!(
            guard("{%+\n  set  ns . x\n= m['content']\n%}x"),
            "{%+\n  set  ns . x\n= (m['content'])|f %}x"
        );
        for kept in [
            "{% set x = 1 %}",
            "{% set ns.x %}text{% endset %}",
            "{% setx.y = 1 %}",
            "{% if ns.x == 1 %}{% endif %}",
            "{% for a.b in c %}{% endfor %}",
        ] {
            assert_eq!(guard(kept), kept);
        }
    }

    #[test]
    fn strings_comments_expressions_and_raw_blocks_are_not_tags() {
        // `%}` inside a string does not end the tag.
        assert_eq!(
            guard("{% set ns.x = '%}' ~ \"{%\" %}"),
            "{% set ns.x = ('%}' ~ \"{%\")|f %}"
        );
        for kept in [
            "{# {% set ns.x = 1 %} #}",
            "{{ '{% set ns.x = 1 %}' }}",
            "{% raw %}{% set ns.x = 1 %}{% endraw %}",
            "{%- raw -%} {% set ns.x = 1 %} {%- endraw %}",
            "{ {x} } {% set",
            "{{ 'unclosed",
            "{% raw %} no end",
            "{#",
        ] {
            assert_eq!(guard(kept), kept);
        }
        assert_eq!(
            guard("{% raw %}a{% endraw %}{% set ns.x = 1 %}"),
            "{% raw %}a{% endraw %}{% set ns.x = (1)|f %}"
        );
        assert_eq!(guard("é{% set ns.é = 1 %}"), "é{% set ns.é = (1)|f %}");
    }

    #[test]
    fn generation_tags_and_their_controls() {
        assert_eq!(generation_tag(" generation "), Some(("", "", false)));
        assert_eq!(generation_tag("- endgeneration +"), Some(("-", "+", true)));
        assert_eq!(generation_tag(" generations "), None);
    }
}
